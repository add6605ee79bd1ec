"""Headline table: Specter's TPOT speedup over every other method, per model and memory tier.

speedup = TPOT(method) / TPOT(specter) (> 1: Specter is faster), paired by prompt: each method's
TPOT on a prompt is the median over its timing repeats (the repeats decode the same tokens, so
they are one sample), one ratio per prompt both measured (same dataset and prompt), and the table
gives the median of those ratios with its percentile-bootstrap 95 % CI over prompts
(specter.records.paired.paired_by_prompt, seeded; the same code as the CLI comparison table).
`prompts` is the bootstrap's unit, `records` the records behind it, `flagged` the records of the
two methods left out for a drifted link. `ci_straddles_1` marks a cell whose interval holds 1:
there the prompts do not say which is faster.
Beside it, the paper's statistics on mean TPOT:
  speedup_avg   on the AVG column of Fig. 14 (mean over datasets)
  mean_speedup  mean over datasets of the per-dataset speedups
  max_speedup   the largest per-dataset speedup
Only methods measured on the same hardware as Specter are compared (an engine run on the bare
CPU is not set against Specter on the emulated link; it has its own figure, fig14_tpot_cpu).
Records flagged for a drifted link are left out of every column (counted per cell and in the notes). A lossy method (token match
with target_only below 1: specter.figures.lossy) is marked `lossy` with its `token_match`.
Rows with model = ALL summarise each method over every (model, tier): the mean of the paired
speedups, of speedup_avg, and the max of max_speedup (the paper's "average 1.50×, up to 1.88×" over
SpecMoEOff); the row `ALL lossless` averages the paired speedups of the lossless methods only.
Each cell's rows carry its two verdicts (specter.figures.verdict): `cpu_verdict` (is Specter fastest on the CPU at
the calibrated link: its CI above 1 against every lossless offloading rival) and `projection_verdict` (in the
projection on the A100: Specter's profiled-K row against each rival's best row); the notes give each with its reason
in numbers, and `table_verdict` holds them one row per model x tier.
"""

from __future__ import annotations

import pandas as pd

from specter.figures import verdict
from specter.figures.common import Output, Skip, order_methods
from specter.figures.data import ResultSet, drifted_note
from specter.figures.lossy import matches_below_target, token_match
from specter.figures.tpot_grid import CI_CHECK_SEEDS, CI_RESAMPLES, CI_SEED, tpot_table
from specter.records.paired import flagged_mask, paired_by_prompt

NAME = "table_headline_speedup"
VERDICT = "table_verdict"
TITLE = ("Headline: Specter's TPOT speedup over each method (median of per-prompt paired ratios, 95 % CI over "
         "prompts; > 1 = Specter faster)")
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
    """Per (model, memory, hardware, method): the median per-prompt paired ratio TPOT(method) / TPOT(reference),
    its 95 % CI over prompts, whether that CI holds 1, and the prompts, records and flagged records behind it
    (specter.records.paired.paired_by_prompt; flagged records in `records` are left out there and counted)."""
    rows = []
    if "hardware" not in records.columns:
        records = records.assign(hardware="unknown")
    records = records.assign(hardware=records["hardware"].fillna("unknown").astype(str))
    for (model, memory, hardware), g in records.groupby(["model", "memory", "hardware"], sort=False):
        if not (g["variant"] == reference).any():
            continue
        for method in order_methods(g["variant"]):
            if method == reference:
                continue
            r = paired_by_prompt(g, "variant", method, reference, resamples=CI_RESAMPLES, seed=CI_SEED)
            if r is None:
                continue
            rows.append({"model": model, "memory": memory, "hardware": hardware, "method": method,
                         "speedup": r.median, "ci_low": r.low, "ci_high": r.high, "prompts": r.prompts,
                         "records": r.records, "flagged": r.flagged, "ci_straddles_1": r.straddles_1,
                         "ci_side": stable_side(g, method, reference, r)})
    return pd.DataFrame(rows)


def side_of_1(low: float, high: float) -> str:
    return "above" if low > 1 else "below" if high < 1 else "holds"


def stable_side(records: pd.DataFrame, method: str, reference: str, first) -> str:
    """Which side of 1 the CI lies on ('above': Specter faster, 'below', 'holds'), or 'unstable' when the
    intervals drawn with CI_CHECK_SEEDS do not all say the same: no verdict word rests on a bootstrap seed."""
    side = side_of_1(first.low, first.high)
    for seed in CI_CHECK_SEEDS:
        r = paired_by_prompt(records, "variant", method, reference, resamples=CI_RESAMPLES, seed=seed)
        if side_of_1(r.low, r.high) != side:
            return "unstable"
    return side


def headline_table(records: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """The paired speedups beside the paper's mean-TPOT statistics, lossy methods marked, ALL rows last.
    Flagged records (load_ratio_off) are left out of every column and counted per cell in `flagged`."""
    paired = paired_table(records, reference)
    if paired.empty:
        return paired
    records = records[~flagged_mask(records)]
    means = speedup_table(tpot_table(records), reference)
    keys = ["model", "memory", "hardware", "method"]
    if not means.empty:
        means = means[means["model"] != "ALL"].drop(columns=["specter_ms", "method_ms"], errors="ignore")
        paired = paired.merge(means, on=keys, how="left")
    match = token_match(records, ("model", "memory", "variant"))  # per cell: a lossy method's match moves with the model
    paired["token_match"] = [match.get(k) for k in zip(paired["model"], paired["memory"], paired["method"])]
    paired["lossy"] = [matches_below_target(x) for x in paired["token_match"]]
    summary = []
    for method, g in paired.groupby("method", sort=False):
        summary.append({"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(g["hardware"]))),
                        "method": method, "speedup": g["speedup"].mean(), "prompts": int(g["prompts"].sum()),
                        "records": int(g["records"].sum()), "flagged": int(g["flagged"].sum()),
                        "speedup_avg": g["speedup_avg"].mean() if "speedup_avg" in g else None,
                        "max_speedup": g["max_speedup"].max() if "max_speedup" in g else None,
                        "token_match": g["token_match"].mean(), "lossy": bool(g["lossy"].any())})
    lossless = paired[~paired["lossy"]]
    if not lossless.empty:
        summary.append({"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(lossless["hardware"]))),
                        "method": "ALL lossless", "speedup": lossless["speedup"].mean(),
                        "prompts": int(lossless["prompts"].sum()), "lossy": False})
    return pd.concat([paired, pd.DataFrame(summary)], ignore_index=True)


def straddling(table: pd.DataFrame) -> list[str]:
    """'model/memory method' of every cell whose CI holds 1."""
    cells = table[(table["model"] != "ALL") & (table["ci_straddles_1"] == True)]  # noqa: E712 - ALL rows: NaN
    return [f"{r.model}/{r.memory} {r.method}" for r in cells.itertuples(index=False)]


def build(results: ResultSet, out: Output) -> None:
    records = results.records("main", drifted=True)  # flagged records: left out by paired_by_prompt, counted per cell
    if records.empty:
        raise Skip("no records.csv")
    records = records.dropna(subset=["tpot_ms"])
    if REFERENCE not in set(records.loc[~flagged_mask(records), "variant"]):
        raise Skip(f"no '{REFERENCE}' records (method=specter with one configuration) to compare against")
    table = headline_table(records)
    if table.empty:
        raise Skip("no other method shares a model, memory tier, hardware and records with specter")
    verdicts = cell_verdicts(results, table, records)
    table = verdict.headline_columns(table, verdicts)
    holds = straddling(table)
    lossy = sorted(set(table.loc[table["lossy"].astype(bool) & (table["model"] != "ALL"), "method"]))
    out.table(table, NAME, TITLE, notes=[
        "speedup: median over `prompts` prompts (same dataset and prompt) of the paired ratio TPOT(method)/TPOT(specter), "
        "each method's TPOT on a prompt being the median over its timing repeats (`records` records in all; repeats "
        "decode the same tokens, so the prompt is the unit); ci_low/ci_high: its percentile-bootstrap 95 % CI over "
        "prompts (20,000 resamples, seed 0; `ci_side` says which side of 1 it lies on, `unstable` where the intervals of seeds 1-4 disagree, and no verdict rests on such a side). `flagged`: records of the two methods left out for a drifted link. "
        + (f"The CI straddles 1 (no sure winner) for: {', '.join(holds)}. " if holds else
           "No cell's CI straddles 1. ")
        + "speedup_avg / mean_speedup / max_speedup: the paper's ratios of mean TPOTs (AVG over datasets, mean and "
        "max over per-dataset ratios). ALL rows: the mean of each method's speedups over every model and tier; "
        "`ALL lossless` averages the lossless methods only"
        + (f" (left out as lossy: {', '.join(lossy)}, token match with target_only below 1). " if lossy else ". ")
        + f"Only methods measured on Specter's hardware are compared. {drifted_note(results.drifted_count('main'))}",
        "", "Verdict per model x tier (is Specter fastest? cpu: its prompt-level CI against every lossless offloading "
        "rival on the calibrated link; projection: on the A100, its profiled-K row against each rival's best row):",
        "", *verdict_lines(verdicts)])
    write_verdicts(verdicts, out)


def cell_verdicts(results: ResultSet, table: pd.DataFrame, records: pd.DataFrame) -> pd.DataFrame:
    """verdict.verdict_table over this result set: the CPU verdicts from the paired table and records, the
    projection verdicts from any projection.csv the projected Fig. 14 finds."""
    from specter.figures.projection import projections

    try:
        proj = projections(results)
    except Skip:
        proj = None
    return verdict.verdict_table(verdict.cpu_verdicts(table, records), verdict.projection_verdicts(proj))


def verdict_lines(verdicts: pd.DataFrame) -> list[str]:
    return [f"- {r.model} ({r.proxy or 'no proxy'}) {r.memory}: CPU **{r.cpu_verdict}** ({r.cpu_reason}); "
            f"projection **{r.projection_verdict}** ({r.projection_reason})" for r in verdicts.itertuples(index=False)]


def write_verdicts(verdicts: pd.DataFrame, out: Output) -> None:
    out.table(verdicts, VERDICT, "Verdict per model and memory tier: is Specter the fastest lossless offloading "
              "method, on the CPU at the calibrated link and in the projection on the A100?", notes=[
                  "cpu_verdict: fastest = Specter's prompt-level paired 95 % CI (table_headline_speedup) lies above 1 "
                  "against every lossless offloading rival measured in the cell; not demonstrated = some CI holds 1 "
                  "(named in the reason); slower than X = the CI against X lies below 1. The reason gives the "
                  "closest rival's interval and each side's expert loads per token (H2D bytes / one expert / new "
                  "tokens), the accepted fraction of K (accepted / drafted tokens, on both sides; α, the per-token "
                  "acceptance, beside it on the CPU) and slots M+S (resident experts per layer + staging buffers). "
                  "projection_verdict: Specter's profiled-K row against each rival's best row in projection.csv on "
                  "the A100 (a model of that machine driven by the engine's schedule, not a measurement), with the "
                  "fastest rival's numbers, the paper's TPOT for it where published, and whether Specter's Belady "
                  "bound (loads/token x one expert's H2D) rules out winning the cell by residency. Rivals: every "
                  "method but Specter, target_only and lossy ones. Tiny proxies stand for the real models they "
                  "mirror (proxy column). 'no CPU records' / 'no projection': nothing to judge on that side."])
