"""The numbers the prose quotes, generated from the result set: README's CPU speedup table and a claims
file (claims.csv / claims.md: key, value, what it is) of every value README and ARTIFACT quote from it.

A value is written as the prose writes it: ratios and fractions with 2 decimals, milliseconds with 1, a
range as "low–high" over the cells it spans. tests/test_claims.py builds both from results/reference and
fails if README's speedup table differs from `speedup_table_md`, or if a decimal number inside a
`<!-- claims -->` … `<!-- /claims -->` region of README.md or ARTIFACT.md is no value of the claims (a
range's ends count), so a number typed by hand goes stale only outside those regions.

    cpu.<model>.<tier>.specter.tpot_ms            Specter's median TPOT over prompts (fig14_tpot, AVG)
    cpu.<model>.<tier>.<method>.speedup / .ci     TPOT(method) / TPOT(specter), paired by prompt, and its CI
    cpu.<model>.<tier>.<method>.loads_per_token   expert loads per new token (verdict.method_facts)
    cpu.<model>.<tier>.specter.alpha / .accepted / .K / .window_vs_independent
    cpu.<model>.<tier>.offload_ar.hit_rate
    cpu.<model>.alpha                             Specter's α over the model's cells (median of records)
    cpu.range.*                                   the ranges the prose quotes (over models, tiers, rivals)
    proj.<model>.<tier>.<method>.tpot_ms          the projection: Specter's profiled-K row, each rival's best
    batch.<model>.<tier>.<method>.B<b>.*          the projected batching, and the paper's batching claims projected
    alpha.<model>.<tier>.<method>.<draft>.*       the projected α curve: α, TPOT, loads per token per draft
"""

from __future__ import annotations

import math

import pandas as pd

from specter.figures import verdict
from specter.figures.common import Output, Skip, method_label, order_models, order_tiers
from specter.figures.data import ResultSet
from specter.figures.headline import REFERENCE, headline_table, order_methods
from specter.figures.tpot_grid import tpot_table
from specter.records.paired import flagged_mask

NAME = "claims"
DASH = "–"  # a range's dash, as the prose writes it


def ratio(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}"


def ms(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.1f}"


def span(values, fmt=ratio) -> str:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "n/a"
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}{DASH}{hi}"


# ---------------------------------------------------------------------------------- the CPU speedup table
def speedup_table_md(paired: pd.DataFrame, tpot: pd.DataFrame) -> str:
    """README's table: per cell Specter's TPOT and each lossless offloading rival's speedup (CI), in the
    figures' legend order; bold where Specter is slower (the CI lies below 1), † where the interval's side of
    1 differs between bootstrap seeds (headline's ci_side 'unstable')."""
    cells = paired[paired["model"] != "ALL"]
    lossy = cells["lossy"].fillna(False).astype(bool) if "lossy" in cells.columns else pd.Series(False, cells.index)
    shown = set(cells.loc[[verdict.is_rival(m, lo) for m, lo in zip(cells["method"], lossy)], "method"])
    rivals = [m for m in order_methods(cells["method"].unique()) if m in shown]
    lines = ["| model | tier | Specter TPOT ms | " + " | ".join(f"× {method_label(m)}" for m in rivals) + " |",
             "|" + "---|" * (3 + len(rivals))]
    avg = tpot[(tpot["dataset"] == "AVG") & (tpot["method"] == REFERENCE)]
    for model in order_models(cells["model"].unique()):
        for memory in order_tiers(cells.loc[cells["model"] == model, "memory"].unique()):
            g = cells[(cells["model"] == model) & (cells["memory"] == memory)].set_index("method")
            t = avg[(avg["model"] == model) & (avg["memory"] == memory)]["median_ms"]
            row = [model, memory, ms(float(t.iloc[0])) if len(t) else "n/a"]
            for method in rivals:
                if method not in g.index:
                    row.append("—")
                    continue
                r = g.loc[method]
                s = ratio(float(r["speedup"]))
                moves = "†" if r.get("ci_side") == "unstable" else ""  # its side of 1 moves with the seed
                row.append(f"{f'**{s}**' if r['ci_high'] < 1 else s} "
                           f"({ratio(float(r['ci_low']))}{DASH}{ratio(float(r['ci_high']))}){moves}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the claims
def cpu_claims(paired: pd.DataFrame, tpot: pd.DataFrame, records: pd.DataFrame) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    clean = records[~flagged_mask(records)]
    avg = tpot[tpot["dataset"] == "AVG"]
    cells = paired[paired["model"] != "ALL"]
    facts: dict[tuple[str, str, str], dict] = {}
    for (model, memory), g in cells.groupby(["model", "memory"], sort=False):
        cell = clean[(clean["model"] == model) & (clean["memory"] == memory)]
        one = verdict.expert_bytes(clean[clean["model"] == model])
        t = avg[(avg["model"] == model) & (avg["memory"] == memory) & (avg["method"] == REFERENCE)]["median_ms"]
        key = f"cpu.{model}.{memory}"
        if len(t):
            out.append((f"{key}.specter.tpot_ms", ms(float(t.iloc[0])), "Specter's median TPOT over prompts, ms"))
        for method in [REFERENCE, *g["method"]]:
            facts[model, memory, method] = f = verdict.method_facts(cell, method, one)
            out.append((f"{key}.{method}.loads_per_token", ratio(f["loads_per_token"]), "expert loads per token"))
        for r in g.itertuples(index=False):
            out.append((f"{key}.{r.method}.speedup", ratio(r.speedup), "TPOT(method) / TPOT(specter), paired"))
            out.append((f"{key}.{r.method}.ci", f"{ratio(r.ci_low)}{DASH}{ratio(r.ci_high)}", "its 95 % CI"))
        spec = facts[model, memory, REFERENCE]
        out += [(f"{key}.specter.alpha", ratio(spec["acceptance"]), "Specter's per-token acceptance α"),
                (f"{key}.specter.accepted", ratio(spec["accepted"]), "accepted / drafted tokens"),
                (f"{key}.specter.K", "n/a" if not math.isfinite(spec["K"]) else str(int(spec["K"])), "K run")]
        ws = _numbers(cell[cell["variant"] == REFERENCE], "window_experts_vs_independent")
        out.append((f"{key}.specter.window_vs_independent", ratio(float(ws.median()) if ws.notna().any() else None),
                    "experts a window touches over independent routing's"))
        hits = _numbers(cell[cell["variant"] == "offload_ar"], "hit_rate")
        out.append((f"{key}.offload_ar.hit_rate", ratio(float(hits.median()) if hits.notna().any() else None),
                    "offload_ar's demand hit rate"))
    return out + _ranges(cells, clean, out) + _means(paired[paired["model"] == "ALL"])


def _means(every: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The ALL rows: per method the mean over cells of the paired speedups and of the mean-TPOT ratios (the
    paper's definition of its averages: the ratio of mean TPOTs), and the largest mean-TPOT ratio of a dataset."""
    rows = []
    for r in every.itertuples(index=False):
        rows += [(f"cpu.all.{r.method}.paired_mean", ratio(r.speedup), "mean over cells of the paired speedups")]
        for col, what in (("speedup_avg", "mean over cells of TPOT(method) / TPOT(specter) by mean TPOT"),
                          ("max_speedup", "the largest mean-TPOT ratio of one dataset")):
            v = getattr(r, col, None)
            if v is not None and not pd.isna(v):
                rows.append((f"cpu.all.{r.method}.{col}", ratio(float(v)), what))
    return rows


def _numbers(records: pd.DataFrame, column: str) -> pd.Series:
    """A column as numbers (NaN where a record or the whole result set has none)."""
    if column not in records.columns:
        return pd.Series(float("nan"), index=records.index, dtype=float)
    return pd.to_numeric(records[column], errors="coerce")


def _ranges(cells: pd.DataFrame, clean: pd.DataFrame, out: list) -> list[tuple[str, str, str]]:
    got = {k: v for k, v, _ in out}

    def values(suffix: str, tier: str | None = None) -> list[float]:
        return [float(v) for k, v in got.items() if k.endswith(suffix) and v != "n/a"
                and (tier is None or k.split(".")[2] == tier)]

    spec = clean[clean["variant"] == REFERENCE]
    alpha = {m: float(_numbers(g, "acceptance_alpha").median()) for m, g in spec.groupby("model", sort=False)}
    rows = [(f"cpu.{m}.alpha", ratio(a), "Specter's α over the model's records (median)") for m, a in alpha.items()]
    rows += [("cpu.range.alpha", span(alpha.values()), "α over the proxies"),
             ("cpu.range.window_vs_independent", span(values(".specter.window_vs_independent")), "over cells"),
             ("cpu.range.specter_accepted", span(values(".specter.accepted")), "over cells"),
             ("cpu.range.specter_accepted.long_windows", span(_long_window_accepted(got)),
              "over the cells whose K is 32 or more")]
    for tier in ("high", "low"):
        rows.append((f"cpu.range.offload_ar.hit_rate.{tier}", span(values(".offload_ar.hit_rate", tier)),
                     f"over the {tier} tier's cells"))
    for method, g in cells.groupby("method", sort=False):
        rows.append((f"cpu.range.{method}.speedup", span(g["speedup"]), "its speedups over the cells"))
        holds = g[(g["ci_low"] <= 1) & (g["ci_high"] >= 1)]
        rows.append((f"cpu.range.{method}.speedup.ci_holds_1", span(holds["speedup"]),
                     "over the cells whose CI holds 1"))
    weak = cells[cells["method"].isin(["offload_ar", "mo_sc", "specmoeoff_artifact"])]
    rows.append(("cpu.range.speedup_over_offload_ar_mo_sc_artifact", span(weak["speedup"], lambda v: f"{v:.1f}"),
                 "Specter's speedups over offload_ar, MO-SC and SpecMoEOff's preset, 1 decimal"))
    return rows


def _long_window_accepted(got: dict[str, str]) -> list[float]:
    return [float(v) for k, v in got.items() if k.endswith(".specter.accepted") and v != "n/a"
            and got.get(k.replace(".accepted", ".K"), "n/a") != "n/a" and int(got[k.replace(".accepted", ".K")]) >= 32]


def projection_claims(results: ResultSet) -> list[tuple[str, str, str]]:
    from specter.figures.projection import projections

    try:
        proj = projections(results)
    except Skip:
        return []
    df = proj[proj["device"].astype(str) == verdict.DEVICE] if "device" in proj.columns else proj
    out = []
    for (model, memory), cell in df.groupby(["model", "memory"], sort=False):
        cell = cell.assign(tpot_ms=pd.to_numeric(cell["tpot_ms"], errors="coerce")).dropna(subset=["tpot_ms"])
        spec = cell[cell["method"] == REFERENCE]
        ks = spec.get("k_source", pd.Series("", index=spec.index)).fillna("").astype(str)
        spec = spec[ks == "profiled"] if (ks == "profiled").any() else spec
        best = pd.concat([spec.sort_values("tpot_ms").head(1),
                          cell[cell["method"] != REFERENCE].sort_values("tpot_ms").drop_duplicates("method")])
        if len(spec):
            row = spec.sort_values("tpot_ms").iloc[0]
            for col, what in (("belady_loads_per_token", "the Belady bound of Specter's profiled-K row"),
                              ("specter_belady_loads_per_token", "Specter's lowest Belady bound over its rows")):
                v = pd.to_numeric(pd.Series([row.get(col)]), errors="coerce").iloc[0]
                out.append((f"proj.{model}.{memory}.specter.{col}", ms(float(v)), f"{what}, loads/token"))
        for r in best.itertuples(index=False):
            what = "Specter's profiled-K row" if r.method == REFERENCE else "its best row"
            out.append((f"proj.{model}.{memory}.{r.method}.tpot_ms", ms(float(r.tpot_ms)),
                        f"projected TPOT on the A100, ms ({what})"))
            loads = pd.to_numeric(pd.Series([getattr(r, "loads_per_token", None)]), errors="coerce").iloc[0]
            out.append((f"proj.{model}.{memory}.{r.method}.loads_per_token", ms(float(loads)),
                        f"its expert loads per token ({what})"))
    return out


def batch_claims(results: ResultSet) -> list[tuple[str, str, str]]:
    """The projected batching (batch_projection.csv, batch_vs_paper.csv of experiment=project) on the A100:
    per model, tier, method and B its TPOT, throughput, loads per token and the ratios to B = 1; and each of
    the paper's batching claims as projected (`.max`: the largest over B, where the paper quotes a maximum)."""
    from specter.figures.projected_batching import read_found

    out = []
    df = read_found(results, "batch_projection.csv", {"method", "batch_size", "tpot_ms", "throughput_tok_s", "device"})
    if not df.empty:
        df = df[df["device"].astype(str) == verdict.DEVICE].drop_duplicates(
            ["model", "memory", "method", "batch_size"], keep="last")
        for r in df.itertuples(index=False):
            key = f"batch.{r.model}.{r.memory}.{r.method}.B{int(r.batch_size)}"
            out += [(f"{key}.tpot_ms", ms(float(r.tpot_ms)), "projected TPOT, ms"),
                    (f"{key}.throughput_tok_s", ms(float(r.throughput_tok_s)), "projected tokens/s"),
                    (f"{key}.tpot_vs_b1", ratio(float(r.tpot_vs_b1)), "TPOT over B = 1's"),
                    (f"{key}.throughput_vs_b1", ratio(float(r.throughput_vs_b1)), "throughput over B = 1's"),
                    (f"{key}.loads_per_token", ms(float(r.loads_per_token)), "expert loads per token")]
    versus = read_found(results, "batch_vs_paper.csv", {"claim", "paper", "projected", "device"})
    if not versus.empty:
        versus = versus[versus["device"].astype(str) == verdict.DEVICE]
        for r in versus.itertuples(index=False):
            key = f"batch.{r.model}.{r.memory}.{r.claim}.{int(r.batch_from)}to{int(r.batch_to)}"
            out.append((key, ratio(float(r.projected)), "the paper's batching claim, projected"))
            if not pd.isna(r.projected_max):
                out.append((f"{key}.max", ratio(float(r.projected_max)), f"its largest over B (at B = "
                            f"{int(r.projected_max_at)})"))
    return out


def alpha_claims(results: ResultSet) -> list[tuple[str, str, str]]:
    """The projected α curve (alpha_curve.csv of experiment=project) on the A100: per model, tier, method and
    draft its α (3 decimals), TPOT (ms) and loads per token."""
    from specter.figures.projected_batching import read_found

    df = read_found(results, "alpha_curve.csv", {"method", "draft", "alpha", "tpot_ms", "device"})
    out = []
    if df.empty:
        return out
    df = df[df["device"].astype(str) == verdict.DEVICE].drop_duplicates(["model", "memory", "method", "draft"],
                                                                          keep="last")
    for r in df.itertuples(index=False):
        key = f"alpha.{r.model}.{r.memory}.{r.method}.{str(r.draft).replace(' ', '_')}"
        out += [(f"{key}.alpha", f"{float(r.alpha):.3f}", "accepted / drafted at its K"),
                (f"{key}.tpot_ms", ms(float(r.tpot_ms)), "projected TPOT, ms"),
                (f"{key}.loads_per_token", ms(float(r.loads_per_token)), "expert loads per token")]
    return out


def claims_table(results: ResultSet) -> tuple[pd.DataFrame, str]:
    """(the claims, README's speedup table) of a result set."""
    records = results.records("main", drifted=True)
    if records.empty:
        raise Skip("no records.csv")
    records = records.dropna(subset=["tpot_ms"])
    paired = headline_table(records)
    if paired.empty:
        raise Skip("no method shares a cell with specter")
    tpot = tpot_table(results.records("main").dropna(subset=["tpot_ms"]))  # as fig14_tpot draws it
    rows = (cpu_claims(paired, tpot, records) + projection_claims(results) + batch_claims(results)
            + alpha_claims(results))
    return pd.DataFrame(rows, columns=["key", "value", "what"]), speedup_table_md(paired, tpot)


def build(results: ResultSet, out: Output) -> None:
    table, speedups = claims_table(results)
    out.table(table, NAME, "The numbers README and ARTIFACT quote from this result set", notes=[
        "Generated by specter/figures/claims.py; tests/test_claims.py checks the prose against it. README's CPU "
        "speedup table, as generated:", "", speedups])
