"""Headline table: Specter's TPOT speedup over every other method, per model and memory tier.

speedup = TPOT(method) / TPOT(specter) (> 1: Specter is faster), paired: one ratio per record both
measured (same dataset, prompt and repeat; in a cell run, seconds apart), and the table gives the
median of those ratios with its percentile-bootstrap 95 % CI (specter.harness.paired, seeded).
`ci_straddles_1` marks a cell whose interval holds 1: there the records do not say which is faster.
Beside it, the paper's statistics on mean TPOT:
  speedup_avg   on the AVG column of Fig. 14 (mean over datasets)
  mean_speedup  mean over datasets of the per-dataset speedups
  max_speedup   the largest per-dataset speedup
Only methods measured on the same hardware as Specter are compared (an engine run on the bare
CPU is not set against Specter on the emulated link; it has its own figure, fig14_tpot_cpu).
Records flagged for a drifted link are left out (counted in the notes). A lossy method (token match
with target_only below 1: specter.figures.lossy) is marked `lossy` with its `token_match`.
Rows with model = ALL summarise each method over every (model, tier): the mean of the paired
speedups, of speedup_avg, and the max of max_speedup (the paper's "average 1.50×, up to 1.88×" over
SpecMoEOff); the row `ALL lossless` averages the paired speedups of the lossless methods only.
"""

from __future__ import annotations

import pandas as pd

from specter.figures.common import Output, Skip, order_methods
from specter.figures.data import ResultSet, drifted_note
from specter.figures.lossy import is_lossy, token_match
from specter.figures.tpot_grid import CI_SEED, tpot_table
from specter.harness.paired import paired_ratio, straddles_one

NAME = "table_headline_speedup"
TITLE = "Headline: Specter's TPOT speedup over each method (median of paired per-record ratios, 95 % CI; > 1 = Specter faster)"
PAIR = ["dataset", "prompt_index", "repeat"]
REFERENCE = "specter"


def speedup_table(tpot: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    rows = []
    if "hardware" not in tpot.columns:
        tpot = tpot.assign(hardware="unknown")
    for (model, memory, hardware), g in tpot.groupby(["model", "memory", "hardware"], sort=False):
        ref = g[g["method"] == reference].set_index("dataset")["mean_ms"]
        if ref.empty:
            continue
        for method in order_methods(g["method"]):
            if method == reference:
                continue
            other = g[g["method"] == method].set_index("dataset")["mean_ms"]
            per_ds = (other / ref).drop("AVG", errors="ignore").dropna()
            if "AVG" not in other.index or per_ds.empty:
                continue
            rows.append({"model": model, "memory": memory, "hardware": hardware, "method": method,
                         "specter_ms": ref["AVG"], "method_ms": other["AVG"],
                         "speedup_avg": other["AVG"] / ref["AVG"],
                         "mean_speedup": per_ds.mean(), "max_speedup": per_ds.max(),
                         "max_at": per_ds.idxmax(), "datasets": len(per_ds)})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    summary = [{"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(g["hardware"]))), "method": method,
                "speedup_avg": g["speedup_avg"].mean(), "mean_speedup": g["mean_speedup"].mean(),
                "max_speedup": g["max_speedup"].max(),
                "max_at": "{}/{}/{}".format(*g.loc[g["max_speedup"].idxmax(), ["model", "memory", "max_at"]]),
                "datasets": int(g["datasets"].sum())}
               for method, g in table.groupby("method", sort=False)]
    return pd.concat([table, pd.DataFrame(summary)], ignore_index=True)


def paired_table(records: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """Per (model, memory, hardware, method): the median paired ratio TPOT(method) / TPOT(reference) over
    the records both measured, its 95 % CI and whether that CI holds 1."""
    rows = []
    if "hardware" not in records.columns:
        records = records.assign(hardware="unknown")
    records = records.assign(hardware=records["hardware"].fillna("unknown").astype(str))
    for (model, memory, hardware), g in records.groupby(["model", "memory", "hardware"], sort=False):
        ref = g[g["variant"] == reference].groupby(PAIR)["tpot_ms"].median()
        if ref.empty:
            continue
        for method in order_methods(g["variant"]):
            if method == reference:
                continue
            other = g[g["variant"] == method].groupby(PAIR)["tpot_ms"].median()
            both = pd.concat([other.rename("other"), ref.rename("ref")], axis=1, join="inner").dropna()
            both = both[(both["other"] > 0) & (both["ref"] > 0)]
            if both.empty:
                continue
            r = paired_ratio(both["other"].tolist(), both["ref"].tolist(), seed=CI_SEED)
            rows.append({"model": model, "memory": memory, "hardware": hardware, "method": method,
                         "speedup": r.median, "ci_low": r.low, "ci_high": r.high, "pairs": r.n,
                         "ci_straddles_1": straddles_one(r.low, r.high)})
    return pd.DataFrame(rows)


def headline_table(records: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """The paired speedups beside the paper's mean-TPOT statistics, lossy methods marked, ALL rows last."""
    paired = paired_table(records, reference)
    if paired.empty:
        return paired
    means = speedup_table(tpot_table(records), reference)
    keys = ["model", "memory", "hardware", "method"]
    if not means.empty:
        means = means[means["model"] != "ALL"].drop(columns=["specter_ms", "method_ms"], errors="ignore")
        paired = paired.merge(means, on=keys, how="left")
    match = token_match(records, ("model", "memory", "variant"))  # per cell: a lossy method's match moves with the model
    paired["token_match"] = [match.get(k) for k in zip(paired["model"], paired["memory"], paired["method"])]
    paired["lossy"] = [is_lossy(x) for x in paired["token_match"]]
    summary = []
    for method, g in paired.groupby("method", sort=False):
        summary.append({"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(g["hardware"]))),
                        "method": method, "speedup": g["speedup"].mean(), "pairs": int(g["pairs"].sum()),
                        "speedup_avg": g["speedup_avg"].mean() if "speedup_avg" in g else None,
                        "max_speedup": g["max_speedup"].max() if "max_speedup" in g else None,
                        "token_match": g["token_match"].mean(), "lossy": bool(g["lossy"].any())})
    lossless = paired[~paired["lossy"]]
    if not lossless.empty:
        summary.append({"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(lossless["hardware"]))),
                        "method": "ALL lossless", "speedup": lossless["speedup"].mean(),
                        "pairs": int(lossless["pairs"].sum()), "lossy": False})
    return pd.concat([paired, pd.DataFrame(summary)], ignore_index=True)


def straddling(table: pd.DataFrame) -> list[str]:
    """'model/memory method' of every cell whose CI holds 1."""
    cells = table[(table["model"] != "ALL") & (table["ci_straddles_1"] == True)]  # noqa: E712 - ALL rows: NaN
    return [f"{r.model}/{r.memory} {r.method}" for r in cells.itertuples(index=False)]


def build(results: ResultSet, out: Output) -> None:
    records = results.records("main")
    if records.empty:
        raise Skip("no records.csv")
    records = records.dropna(subset=["tpot_ms"])
    if REFERENCE not in set(records["variant"]):
        raise Skip(f"no '{REFERENCE}' records (method=specter with one configuration) to compare against")
    table = headline_table(records)
    if table.empty:
        raise Skip("no other method shares a model, memory tier, hardware and records with specter")
    holds = straddling(table)
    lossy = sorted(set(table.loc[table["lossy"].astype(bool) & (table["model"] != "ALL"), "method"]))
    out.table(table, NAME, TITLE, notes=[
        "speedup: median of the paired per-record ratios TPOT(method)/TPOT(specter) over `pairs` records "
        "(same dataset, prompt, repeat); ci_low/ci_high: its percentile-bootstrap 95 % CI (2,000 resamples, seed 0). "
        + (f"The CI straddles 1 (no sure winner) for: {', '.join(holds)}. " if holds else
           "No cell's CI straddles 1. ")
        + "speedup_avg / mean_speedup / max_speedup: the paper's ratios of mean TPOTs (AVG over datasets, mean and "
        "max over per-dataset ratios). ALL rows: the mean of each method's speedups over every model and tier; "
        "`ALL lossless` averages the lossless methods only"
        + (f" (left out as lossy: {', '.join(lossy)}, token match with target_only below 1). " if lossy else ". ")
        + f"Only methods measured on Specter's hardware are compared. {drifted_note(results.drifted_count('main'))}"])
