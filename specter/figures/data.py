"""Finding and reading result CSVs: records, K sweeps, kernel benchmarks, routes, batches, traces.

A *result set* is a folder searched recursively. Inside it:

  records.csv          one row per generated sequence (specter/records/records.py), beside the run's
                       config.yaml; records under a `K=<k>` folder are K-sweep points (read through
                       k_sweep.csv), under a `B=<b>` folder batched requests (read through batch.csv),
                       under a `bench` folder side benchmarks (prefetch ablations), under a
                       `load_ratio` folder the load-ratio sweep (read through load_ratio.csv), and
                       runs that traced their windows (method.trace_windows, or a `trace` folder)
                       traced runs: all kept apart from the main grid (specter/figures/labels.py)
  k_sweep.csv          one row per K (+ k_profile.json: the chosen K)
  draft_kernel*.csv    draft-kernel benchmark (scripts/bench_draft_kernel.py)
  verify_schedule.csv  expert-wise vs token-wise verification (scripts/bench_verify.py)
  routes.csv.gz        dataset,prompt_index,repeat,window,layer,expert,count (or plain routes.csv)
  batch.csv            method,model,memory,batch_size,dataset,tpot_median_ms,tpot_p90_ms,
                       throughput_tok_s,distinct_experts_per_layer,h2d_bytes_per_token,acceptance
  trace.csv.gz         window,event,layer,expert,start_ms,end_ms,bytes,phase (or plain trace.csv)
  load_ratio.csv       model,memory,method,load_ratio,tpot_ms,effective_load_ratio,... (experiment=load_ratio_sweep)

The per-window side tables (routes, trace) are written gzip-compressed; either form is read, and
a folder holding both counts once (the form specter.records.artifacts.side_path names).
records.csv, batch.csv, routes.csv and trace.csv are read through the harness's validated row
reader (specter/records/rowstore.py), the same one the summaries use: a torn, non-UTF-8 or
non-numeric row is left out with a note naming its file and line, never read as data. Of routes
and trace rows, only the last block of each record key counts, and only for records the folder's
records.csv holds as finished. Other CSVs (written atomically by their scripts) and config.yaml
are read as they are; one that cannot be parsed is skipped with a note. A figure uses the columns
it needs and skips with a note otherwise.

A result set that ships with a manifest (`SHA256SUMS` in the folder, or the checkout's SHA256SUMS
listing files under it, as for results/reference) is read through it: only the files it lists
count, so a file dropped into a shipped tree is never drawn. A folder no manifest covers (your
own runs) is read whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from specter.figures.common import REAL_OF_TINY
from specter.figures.labels import method_settings, record_source, variant_labels  # noqa: F401 (re-exported)

INPUT_NAMES = ("records.csv", "k_sweep.csv", "draft_kernel*.csv", "verify_schedule.csv", "routes.csv",
               "routes.csv.gz", "batch.csv", "trace.csv", "trace.csv.gz", "load_ratio.csv")
SIDE_NAMES = ("routes.csv", "trace.csv")  # also read as <name>.gz
# Folders directly under results/ that hold other result sets (or no results at all).
SET_ASIDE = ("reference", "paper", "logs", "multirun", "quick")


def has_inputs(root: Path, set_aside: tuple[str, ...] = ()) -> bool:
    return any(True for _ in _walk(root, INPUT_NAMES, set_aside))


def default_results(repo: Path) -> Path:
    """results/ (less its set-aside folders) if it holds a result CSV, else results/quick, else
    results/reference."""
    results = repo / "results"
    if results.is_dir() and has_inputs(results, SET_ASIDE):
        return results
    if has_inputs(results / "quick"):
        return results / "quick"
    return results / "reference"


MANIFEST = "SHA256SUMS"


def _manifest_names(path: Path) -> tuple[str, ...]:
    """The file names a SHA256SUMS lists (`<sha256>  <name>` lines; other lines ignored)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ()
    names = []
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if sep and len(digest) == 64 and name:
            names.append(name)
    return tuple(names)


def manifest(root: Path) -> frozenset[Path] | None:
    """The files of `root` its manifest lists (resolved paths), or None when no manifest covers it:
    `root/SHA256SUMS`, else the nearest SHA256SUMS above it if that one lists files under `root`."""
    root = Path(root).resolve()
    own = root / MANIFEST
    if own.is_file():
        return frozenset(root / n for n in _manifest_names(own))
    for folder in root.parents:
        sums = folder / MANIFEST
        if sums.is_file():
            rel = root.relative_to(folder).as_posix() + "/"
            listed = frozenset(folder / n for n in _manifest_names(sums) if n.startswith(rel))
            return listed or None
    return None


def _walk(root: Path, patterns: tuple[str, ...], set_aside: tuple[str, ...] = ()):
    if not root.is_dir():
        return
    listed = manifest(root)
    for pattern in patterns:
        for path in sorted(root.rglob(pattern)):
            if listed is not None and path.resolve() not in listed:
                continue
            rel = path.relative_to(root).parts
            if rel and rel[0] in set_aside and len(rel) > 1:
                continue
            yield path


def read_yaml(path: Path) -> dict[str, Any]:
    """config.yaml as a dict (PyYAML when installed; else a reader of the nested-mapping subset)."""
    text = path.read_text()
    try:
        import yaml

        return yaml.safe_load(text) or {}
    except ImportError:
        return _mini_yaml(text)


def _mini_yaml(text: str) -> dict[str, Any]:
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip()
        if not line.strip() or line.lstrip().startswith(("#", "- ")) or ":" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        value = value.strip()
        if value == "":
            parent[key] = {}
            stack.append((indent, parent[key]))
        else:
            parent[key] = _scalar(value)
    return root


def _scalar(value: str):
    if value in ("null", "~"):
        return None
    if value in ("true", "false"):
        return value == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value.strip("'\"")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class ResultSet:
    """One folder of results, read lazily; `paper` is the folder of the paper's typed numbers."""

    def __init__(self, root: Path, paper: Path | None = None):
        self.root = Path(root)
        self.paper = Path(paper) if paper is not None else None
        self._configs: dict[Path, dict[str, Any]] = {}
        self._records: pd.DataFrame | None = None

    def files(self, *patterns: str) -> list[Path]:
        """Matching files below the root, less the set-aside folders directly under it (a results/
        root holds quick/, reference/ ... beside its own runs: other result sets)."""
        return list(_walk(self.root, patterns, SET_ASIDE))

    def config(self, folder: Path) -> dict[str, Any]:
        folder = Path(folder)
        if folder not in self._configs:
            path = folder / "config.yaml"
            data: Any = {}
            if path.exists():
                try:
                    data = read_yaml(path)
                except Exception as err:  # noqa: BLE001 - YAML parsers raise many types
                    print(f"note: {path} cannot be read ({type(err).__name__}); its run is labelled from its CSVs")
                    data = {}
            self._configs[folder] = data if isinstance(data, dict) else {}
        return self._configs[folder]

    def family(self, model: str, folder: Path | None = None) -> str:
        """The real model a (tiny) model mirrors: model.real from config.yaml, else a name map."""
        if folder is not None:
            real = (self.config(folder).get("model") or {}).get("real")
            if real:
                return str(real)
        return REAL_OF_TINY.get(model, model)

    # ------------------------------------------------------------ records

    def _all_records(self) -> pd.DataFrame:
        if self._records is None:
            self._records = self._read_records()
        return self._records

    def _read_records(self) -> pd.DataFrame:
        frames = []
        for path in self.files("records.csv"):
            rel = path.parent.relative_to(self.root).parts
            if any(p.startswith("K=") for p in rel):
                continue  # K-sweep points: read through k_sweep.csv
            df = read_validated(path)
            if df is None or df.empty or "method" not in df.columns or "tpot_ms" not in df.columns:
                continue
            df = finite_rows(path, df)
            if df.empty:
                continue
            cfg = self.config(path.parent)
            for col, key in (("model", "model"), ("memory", "memory"), ("dataset", "dataset")):
                if col not in df.columns:
                    df[col] = (cfg.get(key) or {}).get("name")
            if "hardware" not in df.columns:
                df["hardware"] = (cfg.get("hardware") or {}).get("name")
            if "repeat" not in df.columns:
                df["repeat"] = 0
            df["run"] = str(path.parent.relative_to(self.root)) or "."
            df["family"] = [self.family(str(m), path.parent) for m in df["model"]]
            # method labelling and grouping (specter/figures/labels.py)
            method_cfg = flatten(cfg.get("method") or {})
            df["source"] = record_source(rel, method_cfg)
            settings = method_settings(method_cfg)
            if "K" in df.columns and df["K"].notna().any():  # the speculation depth the run used (top-level K)
                settings["K"] = ",".join(str(int(k)) for k in sorted(pd.to_numeric(df["K"]).dropna().unique()))
            df["_method_cfg"] = json.dumps(settings, sort_keys=True, default=str)
            frames.append(df)
        if not frames:
            return pd.DataFrame()
        records = pd.concat(frames, ignore_index=True)
        for col in ("tpot_ms", "tpot_fair_ms", "ttft_ms", "e2e_ms", "new_tokens", "accepted_tokens",
                    "drafted_tokens", "acceptance_rate", "acceptance_alpha", "accepted_fraction", "h2d_bytes",
                    "oracle_h2d_bytes", "K", "batch_size"):
            if col in records.columns:
                records[col] = pd.to_numeric(records[col], errors="coerce")
        records["variant"] = records["method"].astype(str)
        for source in records["source"].unique():
            sel = records["source"] == source
            records.loc[sel, "variant"] = variant_labels(records.loc[sel])
        return records.drop(columns="_method_cfg")

    def records(self, source: str = "main", drifted: bool = False) -> pd.DataFrame:
        """Records of the main grid ('main'), traced runs ('trace'), side benchmarks ('bench'), batches
        ('batch') or all ('all'). Records whose emulated link drifted off its load ratio
        (`load_ratio_off`) are left out unless `drifted`; `drifted_count(source)` says how many."""
        df = self._all_records()
        if df.empty:
            return df
        if source != "all":
            if "batch_size" in df.columns:  # batched records belong to the batching figures
                df = df[df["batch_size"].isna() | (df["batch_size"] <= 1)]
            df = df[df["source"] == source]
        if not drifted:
            off = drifted_mask(df)
            df = df[~off]
        return df.reset_index(drop=True)

    def drifted_count(self, source: str = "main") -> int:
        """Records of `source` left out of the figures because their link drifted (`load_ratio_off`)."""
        return int(drifted_mask(self.records(source, drifted=True)).sum())

    # ------------------------------------------------------------ other inputs

    def csvs(self, pattern: str, folders: Callable[[Path], bool] | None = None) -> list[tuple[Path, pd.DataFrame]]:
        """Every readable CSV matching `pattern`; a side table (routes.csv, trace.csv) in either form,
        one per folder; with `folders`, only those in a folder it keeps (decided before reading: a
        reference set holds hundreds of route tables, most of them of K sweeps)."""
        out = []
        for path in (self._side_files(pattern) if pattern in SIDE_NAMES else self.files(pattern)):
            if folders is not None and not folders(path.parent):
                continue
            df = read_validated(path)
            if df is not None and not df.empty:
                out.append((path, df))
        return out

    def _side_files(self, name: str) -> list[Path]:
        """One file per folder of side table `name`: `<name>.gz` where it is found, else plain `<name>`
        (the writer's choice, specter.records.artifacts.side_path, when both exist)."""
        found = self.files(name, f"{name}.gz")
        gz = {p.parent for p in found if p.name.endswith(".gz")}
        return sorted(p for p in found if p.name.endswith(".gz") or p.parent not in gz)

    def run_info(self, folder: Path) -> dict[str, Any]:
        """model / memory / method / hardware of a run folder, from its config.yaml."""
        cfg = self.config(folder)
        name = lambda key: (cfg.get(key) or {}).get("name") if isinstance(cfg.get(key), dict) else cfg.get(key)
        model = name("model")
        return {"model": model, "memory": name("memory"), "method": name("method"), "hardware": name("hardware"),
                "family": self.family(str(model), folder) if model else None,
                "run": str(Path(folder).relative_to(self.root)) if Path(folder).is_relative_to(self.root) else str(folder)}


# A record's times are drawn and compared only as finite numbers: an `inf` (a hand edit or a bug) would
# end the paired statistics of every figure that reads it in an error.
FINITE_TIMES = ("tpot_ms", "tpot_fair_ms", "ttft_ms", "e2e_ms")


def finite_rows(path: Path, df: pd.DataFrame) -> pd.DataFrame:
    """`df` without the records whose times are not finite numbers, each file's left-out rows named in a note."""
    bad = pd.Series(False, index=df.index)
    reasons = []
    for col in (c for c in FINITE_TIMES if c in df.columns):
        off = pd.to_numeric(df[col], errors="coerce").abs().eq(float("inf"))
        if off.any():
            shown = sorted({str(v) for v in df.loc[off, col]})
            reasons.append(f"{col}={', '.join(shown[:3])}")
            bad |= off
    if bad.any():
        print(f"note: {path}: {int(bad.sum())} record(s) left out of every figure, their times are not finite "
              f"numbers ({'; '.join(reasons)})")
    return df[~bad].reset_index(drop=True)


def drifted_mask(records: pd.DataFrame) -> pd.Series:
    """Records flagged for a drifted link (records.csv `load_ratio_off` = 1): specter.records.paired.flagged_mask."""
    from specter.records.paired import flagged_mask

    return flagged_mask(records)


def drifted_note(count: int) -> str:
    """The caption's count of left-out records."""
    return f"{count} record(s) flagged for a drifted link (load_ratio_off) left out." if count else \
        "No record flagged for a drifted link."


def _schemas() -> dict[str, Any]:
    from specter.records.artifacts import SIDE_TABLES
    from specter.records.batch_schema import BATCH_SCHEMA
    from specter.records.records import SCHEMA as RECORDS

    return {"records.csv": RECORDS, "batch.csv": BATCH_SCHEMA,
            **{f"{name}.csv": schema for name, schema in SIDE_TABLES.items()}}


def _joined(df: pd.DataFrame, columns: list[str]) -> pd.Series:
    """Each row's `columns` as one "a/b/c" string, column-wise (a row-wise join took minutes per
    100,000-row route table)."""
    keys = df[columns[0]].astype(str)
    for c in columns[1:]:
        keys = keys + "/" + df[c].astype(str)
    return keys


def read_validated(path: Path) -> pd.DataFrame | None:
    """A result CSV as a DataFrame, or None (with a note) when it cannot be read.

    Row tables go through the validated reader (invalid rows noted and left out; side tables cut to
    the finished records of their folder); any other CSV is read as it is."""
    path = Path(path)
    note = lambda msg: print(f"note: {msg}")  # noqa: E731
    schema = _schemas().get(path.name.removesuffix(".gz"))
    if schema is None:
        try:
            return pd.read_csv(path)
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError, OSError) as err:
            note(f"{path} could not be read ({type(err).__name__}); ignored")
            return None
    from specter.records.rowstore import RowStoreError, read_frame

    try:
        df = read_frame(path, schema, warn=note, exact=False)
    except RowStoreError as err:
        note(f"{err}; ignored")
        return None
    if schema.blocks and (path.parent / "records.csv").exists() and set(schema.key) <= set(df.columns):
        finished = finished_keys(path.parent / "records.csv", schema.key)
        if finished is not None:
            keys = _joined(df, list(schema.key))
            kept = keys.isin(finished)
            if not kept.all():
                note(f"{path}: {int((~kept).sum())} rows of unfinished records left out")
            df = df[kept].reset_index(drop=True)
    return df


def finished_keys(records: Path, key: tuple[str, ...]) -> set[str] | None:
    """`key` of every finished record in a records.csv, as "a/b/c" strings (None: unreadable)."""
    from specter.records.records import SCHEMA as RECORDS
    from specter.records.rowstore import RowStoreError, read_table

    try:
        table = read_table(records, RECORDS, warn=lambda msg: None, exact=False)
    except RowStoreError:
        return None
    if not set(key) <= set(table.header):
        return None
    return {"/".join(v.get(c, "") for c in key) for v in table.values()}
