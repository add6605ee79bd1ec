"""`experiment=compare`: several methods side by side on the same prompts, one table at the end.

What `python run.py` runs with no arguments: target-only decoding, autoregressive offloading and
Specter at the low memory tier on a briefly trained tiny model over the emulated link — the
comparison the project exists for. Each method is an ordinary resumable run in
`<output_dir>/<method>/`; the table is written to `<output_dir>/compare.csv`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from specter.assembly.config import ConfigError
from specter.records.paired import paired_by_prompt
from specter.records.records import read_records
from specter.paths import safe_name, write_table

DEFAULT_METHODS = ("target_only", "offload_ar", "specter")


def method_config(cfg: DictConfig, method: str) -> DictConfig:
    """`cfg` with its method group switched to `method` (as `method=<method>` would compose it)."""
    from specter.assembly.compose import compose

    try:
        node = compose([f"method={method}"]).method
    except Exception as err:  # noqa: BLE001 - Hydra's own message names the missing option
        raise ConfigError(f"compare.methods: cannot compose method={method} ({str(err).splitlines()[0]})") from None
    sub = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(sub):
        sub.method = node
        for key, value in (cfg.compare.get("method_overrides") or {}).get(method, {}).items():
            OmegaConf.update(sub, f"method.{key}", value, force_add=True)
        sub.experiment = "run"
        sub.output_dir = str(Path(cfg.output_dir) / method)
    return sub


def comparison_table(records: pd.DataFrame, reference: str = "target_only", baseline: str = "offload_ar") -> pd.DataFrame:
    """One row per method: TPOT, speedup over `baseline` (ratio of median TPOTs, and the paired speedup at the
    prompt level: each prompt's median TPOT over its repeats, the median of the per-prompt ratios over the prompts
    both ran, its bootstrap CI over prompts and whether that CI holds 1; records flagged for a drifted link are
    left out of it and counted in `load_ratio_off`), acceptance, I/O against the oracle, the routing regime (cache
    hit rate, window working set over independent routing), token equality."""
    rows = []
    ref = records[records.method == reference].set_index(_PAIR_KEY).output_digest
    base_tpot = records[records.method == baseline].tpot_ms.median() if (records.method == baseline).any() else None
    for method, df in records.groupby("method", sort=False):
        digests = df.set_index(_PAIR_KEY).output_digest
        common = digests.index.intersection(ref.index)
        same = bool((digests[common] == ref[common]).all()) if len(common) else None
        tpot = df.tpot_ms.median()
        h2d = df.h2d_bytes.sum() if df.h2d_bytes.notna().any() else None
        oracle = df.oracle_h2d_bytes.sum() if df.oracle_h2d_bytes.notna().any() else None
        rows.append({
            "method": method, "records": len(df), "tpot_ms": tpot,
            f"speedup_vs_{baseline}": base_tpot / tpot if base_tpot and tpot else None,
            **_paired_columns(records, baseline, method),
            "acceptance_alpha": df.acceptance_alpha.mean() if df.acceptance_alpha.notna().any() else None,
            "tokens_per_iteration": df.mean_accepted_len.mean() if df.mean_accepted_len.notna().any() else None,
            "h2d_mb_per_token": h2d / df.new_tokens.sum() / 1e6 if h2d is not None else None,
            "h2d_over_oracle": h2d / oracle if h2d is not None and oracle else None,
            # the routing regime: demand hit rate of the device cache, distinct experts per window over independent routing
            "hit_rate": _mean(df, "hit_rate"),
            "window_experts_vs_independent": _mean(df, "window_experts_vs_independent"),
            f"same_tokens_as_{reference}": same,
            **_ratio_columns(df),
        })
    return pd.DataFrame(rows)


_PAIR_KEY = ["dataset", "prompt_index", "repeat"]  # one record: the same prompt and repeat (token equality)


def _paired_columns(records: pd.DataFrame, baseline: str, method: str) -> dict:
    """TPOT(baseline) / TPOT(method) paired by prompt (specter.records.paired.paired_by_prompt): the median of the
    per-prompt ratios, its 95% bootstrap CI over prompts, whether it holds 1, and the prompts paired; None (and
    0 prompts) where the two share none."""
    r = paired_by_prompt(records, "method", baseline, method) if (records.method == baseline).any() else None
    if r is None:
        return {"speedup_paired_median": None, "speedup_ci_low": None, "speedup_ci_high": None,
                "ci_straddles_1": None, "prompts": 0}
    return {"speedup_paired_median": r.median, "speedup_ci_low": r.low, "speedup_ci_high": r.high,
            "ci_straddles_1": None if method == baseline else r.straddles_1,  # the baseline is 1 by definition
            "prompts": r.prompts}


def _mean(df: pd.DataFrame, column: str) -> float | None:
    """Mean of a record column over a method's records; None where the column is missing or empty."""
    return df[column].mean() if column in df and df[column].notna().any() else None


def _ratio_columns(df: pd.DataFrame) -> dict:
    """Configured and mean effective load ratio of a method's records, and how many were flagged."""
    if "effective_load_ratio" not in df or df.effective_load_ratio.isna().all():
        return {"load_ratio": None, "effective_load_ratio": None, "load_ratio_off": None}
    return {"load_ratio": df.load_ratio.dropna().iloc[0] if df.load_ratio.notna().any() else None,
            "effective_load_ratio": df.effective_load_ratio.mean(), "load_ratio_off": int(df.load_ratio_off.sum())}


def compare(cfg: DictConfig) -> Path:
    from specter.experiments.run import run

    methods = list(cfg.compare.get("methods") or DEFAULT_METHODS)
    if not methods:
        raise ConfigError("compare.methods is empty")
    for method in methods:  # each becomes a folder name under output_dir
        safe_name(method, "compare.methods entry")
    root = Path(cfg.output_dir)
    frames = []
    for method in methods:
        print(f"\n== {method} ==", flush=True)
        out = run(method_config(cfg, method))
        frames.append(read_records(out / "records.csv"))
    table = comparison_table(pd.concat(frames, ignore_index=True))
    write_table(root / "compare.csv", table)
    print_comparison(table, title=f"{cfg.model.name} at memory={cfg.memory.name}, hardware={cfg.hardware.name} "
                                  f"({root / 'compare.csv'})")
    return root


def print_comparison(table: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    holds = "ci_straddles_1" in table and bool((table["ci_straddles_1"] == True).any())  # noqa: E712 - None rows
    base = next((c.removeprefix("speedup_vs_") for c in table.columns if c.startswith("speedup_vs_")), "baseline")
    t = Table(title=title, header_style="bold", caption=f"paired ×: median over prompts of TPOT({base})/TPOT(method), "
              "each prompt's TPOT the median over its repeats, [95% bootstrap CI over prompts]"
              + ("; ∋1: the CI straddles 1 (no sure winner)" if holds else "")
              + "; r off: records flagged for a drifted link, left out of paired ×")
    # the CI and whether it holds 1 are shown with the median
    cols = [c for c in table.columns if c not in ("speedup_ci_low", "speedup_ci_high", "ci_straddles_1")]
    for col in cols:
        t.add_column(_HEADERS.get(col, col.replace("_", " ")), justify="left" if col == "method" else "right",
                     no_wrap=True)
    for _, row in table.iterrows():
        t.add_row(*[_fmt_paired(row) if c == "speedup_paired_median" else _fmt(row[c]) for c in cols])
    # as wide as the table's natural width: a header folded over two lines ("TPOT" / "ms") or a cell cut
    # to "recor…" is unreadable, and whoever greps the output (CI does, for "TPOT ms") misses it
    natural = Console(width=1000).measure(t).maximum
    Console(width=max(100, natural)).print(t)


_HEADERS = {"tpot_ms": "TPOT ms", "speedup_vs_offload_ar": "× vs offload_ar",
            "speedup_paired_median": "paired ×", "acceptance_alpha": "α",
            "tokens_per_iteration": "tokens/iter", "h2d_mb_per_token": "H2D MB/token",
            "h2d_over_oracle": "H2D ÷ oracle", "hit_rate": "hit", "window_experts_vs_independent": "WS÷ind",
            "same_tokens_as_target_only": "= target_only",
            "load_ratio": "r set", "effective_load_ratio": "r run", "load_ratio_off": "r off"}


def _fmt_paired(row) -> str:
    """The paired speedup median with its CI, e.g. `2.15 [1.92–2.41]`, and `∋1` where the CI holds 1."""
    median, low, high = (row.get(c) for c in ("speedup_paired_median", "speedup_ci_low", "speedup_ci_high"))
    if _fmt(median) == "—":
        return "—"
    holds = row.get("ci_straddles_1")
    return f"{median:.3g} [{low:.3g}–{high:.3g}]" + (" ∋1" if holds is True or holds == 1.0 else "")


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "—"
    if isinstance(v, (bool,)) or str(v) in ("True", "False"):
        return "yes" if str(v) == "True" else "NO"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
