"""What staging buffers buy: each cache-owning method with the resource rule's staging buffers
(the main grid) beside the same run with `method.staging_buffers=0` (an `ablation/staging0` folder).

Every cache-owning method gets staging buffers by one rule (what the tier's budget holds beyond
its design, at most 1.2 per MoE layer), so this is the same facility removed from all of them.
gain = median TPOT without ÷ median TPOT with (> 1: the buffers helped).
"""

from __future__ import annotations

import pandas as pd

from specter.figures.common import Output, Skip, ratio_bars
from specter.figures.data import ResultSet
from specter.figures.labels import legend_label, token_match_of

NAME = "fig_staging_ablation"
ABLATION = "staging0"  # the folder below ablation/ that holds the method.staging_buffers=0 runs
CELL = ["model", "memory", "hardware", "method"]


def is_staging_ablation(run: object) -> bool:
    """Whether a record's run folder (relative to the result root) is one of the staging ablation's."""
    return f"ablation/{ABLATION}" in str(run).replace("\\", "/")


def _medians(records: pd.DataFrame, suffix: str) -> pd.DataFrame:
    g = records.groupby(CELL)
    out = pd.DataFrame({f"tpot_ms{suffix}": g["tpot_ms"].median()})
    if "staging_buffers" in records.columns:
        out[f"staging_buffers{suffix}"] = g["staging_buffers"].first()
    if "footprint_bytes" in records.columns:
        out[f"footprint_mb{suffix}"] = g["footprint_bytes"].first() / (1 << 20)
    return out


def staging_table(results: ResultSet) -> pd.DataFrame:
    bench = results.records("bench")
    if bench.empty or "run" not in bench.columns:
        return pd.DataFrame()
    ablated = bench[bench["run"].map(is_staging_ablation)]
    main = results.records("main")
    if ablated.empty or main.empty:
        return pd.DataFrame()
    main = main[main["method"].isin(set(ablated["method"]))]
    table = _medians(main, "").join(_medians(ablated, "_no_staging"), how="inner").reset_index()
    table["gain"] = table["tpot_ms_no_staging"] / table["tpot_ms"]
    return table


def build(results: ResultSet, out: Output) -> None:
    table = staging_table(results)
    if table.empty:
        raise Skip("no ablation/staging0 runs beside the main grid (reproduce_all runs them: method.staging_buffers=0)")
    out.table(table, NAME, "What staging buffers buy: every cache-owning method with and without them", notes=[
        "staging_buffers: the count the rule gave the main run (what the budget holds beyond the method's design, "
        "at most 1.2 per MoE layer); _no_staging: the same run with method.staging_buffers=0.",
        "gain = median TPOT without / with (> 1: the buffers helped)."])
    match = token_match_of(results.records("main"))
    ratio_bars(out, table, NAME, "gain", "TPOT without / with staging",
               labels={m: legend_label(m, match.get(m)) for m in table["method"].unique()})
