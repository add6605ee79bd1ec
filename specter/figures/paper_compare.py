"""Paper vs here: the paper's reported numbers (results/paper/*.csv) beside the ones measured here.

Absolute times are not comparable across machines and model sizes; ratios are. Each row gives
the paper's value, ours for the same quantity (our model mapped to the real one it mirrors:
tiny_dsv2 -> dsv2, ...), and here / paper. The table says what "here" is (e.g. "tiny models on an
emulated link").
"""

from __future__ import annotations

import pandas as pd

from specter.figures import batching, headline, k_sweep
from specter.figures.common import Output, Skip, method_label
from specter.figures.data import ResultSet
from specter.figures.tpot_grid import tpot_table

NAME = "paper_vs_here"


def setting(records: pd.DataFrame) -> str:
    if records.empty:
        return "no records"
    tiny = records["model"].astype(str).str.startswith("tiny_").any()
    hw = set(records["hardware"].dropna().astype(str))
    where = "an emulated link" if "emulated" in hw else "a GPU" if "cuda" in hw else "the CPU"
    return f"{'tiny' if tiny else 'real'} models on {where}"


def _read(paper, name: str) -> pd.DataFrame:
    path = paper / name
    return pd.read_csv(path) if path.exists() else pd.DataFrame()


def compare(results: ResultSet) -> pd.DataFrame:
    paper = results.paper
    records = results.records("main")
    rows: list[dict] = []

    def add(quantity, model, paper_value, here_value, unit, here_model="", note=""):
        here = None if here_value is None or pd.isna(here_value) else float(here_value)
        rows.append({"quantity": quantity, "model": model, "here_model": here_model, "unit": unit,
                     "paper": float(paper_value), "here": here,
                     "here_over_paper": here / float(paper_value) if here is not None and paper_value else None,
                     "note": note})

    tpot = tpot_table(records.dropna(subset=["tpot_ms"])) if not records.empty else pd.DataFrame()
    fam = records.drop_duplicates("model").set_index("model")["family"].to_dict() if not records.empty else {}
    if not tpot.empty:
        tpot = tpot.assign(family=tpot["model"].map(fam))
    # single-request TPOT: Specter's speedup over each method, high memory, AVG over datasets
    paper_tpot = _read(paper, "tpot_single_request.csv")
    for model, g in (paper_tpot.groupby("model", sort=False) if not paper_tpot.empty else ()):
        p = g.set_index("method")["tpot_ms"]
        here = tpot[(tpot["family"] == model) & (tpot["memory"] == "high") & (tpot["dataset"] == "AVG")] \
            if not tpot.empty else pd.DataFrame(columns=["method", "mean_ms", "model"])
        h = here.set_index("method")["mean_ms"] if not here.empty else pd.Series(dtype=float)
        hw = here.set_index("method")["hardware"] if not here.empty and "hardware" in here else pd.Series(dtype=str)
        here_model = ",".join(sorted(set(here["model"]))) if not here.empty else ""
        if "specter" in p:
            add("TPOT of Specter, high memory, AVG", model, p["specter"], h.get("specter"), "ms/token", here_model)
        for method in p.index.drop("specter", errors="ignore"):
            here_ratio, note = None, "" if method in h else f"no {method} records here"
            if method in h and "specter" in h:
                if hw.get(method) == hw.get("specter"):
                    here_ratio = h[method] / h["specter"]
                else:  # an engine on the bare CPU against Specter on the emulated link: no one hardware
                    note = f"not compared: {method} ran on {hw.get(method)}, specter on {hw.get('specter')}"
            add(f"speedup of Specter over {method_label(method)}, high memory, AVG", model,
                p[method] / p["specter"], here_ratio, "x", here_model, note)
    # K chosen per model (high memory where swept, else any tier)
    sweeps = k_sweep.sweep_table(results)
    for r in _read(paper, "k_profile.csv").itertuples(index=False):
        here_k, here_model = None, ""
        if not sweeps.empty:
            chosen = sweeps[sweeps["chosen"]].copy()
            chosen["family"] = [results.family(str(m)) for m in chosen["model"]]
            c = chosen[chosen["family"] == r.model].sort_values("memory")
            c = c[c["memory"] == "high"] if (c["memory"] == "high").any() else c
            if not c.empty:
                here_k, here_model = c["K"].iloc[0], c["model"].iloc[0]
        add("chosen K (lowest mean TPOT)", r.model, r.K, here_k, "tokens", here_model)
    # ratios the paper quotes
    speed = headline.speedup_table(tpot) if not tpot.empty and "specter" in set(tpot["method"]) else pd.DataFrame()
    spec = records[records["method"] == "specter"] if not records.empty else None
    batch = batching.load_batch(results)
    scale = batching.scaling_table(batching.averaged(batch), batching.refusals(results)) if not batch.empty \
        else pd.DataFrame()
    for r in _read(paper, "claims.csv").itertuples(index=False):
        here, here_model = None, ""
        if r.claim in ("speedup_mean", "speedup_max") and not speed.empty:
            s = speed[(speed["model"] == "ALL") & (speed["method"] == r.baseline)]
            if not s.empty:
                here = s["speedup_avg" if r.claim == "speedup_mean" else "max_speedup"].iloc[0]
        elif spec is not None and (r.claim.startswith("acceptance") or r.claim == "expected_accepted_run"):
            sel = spec if r.model == "ALL" else spec[spec["family"] == r.model]
            if not sel.empty and "drafted_tokens" in sel and sel["drafted_tokens"].sum() > 0:
                if r.claim == "acceptance_max":
                    per = pd.Series({m: _alpha(g) for m, g in sel.groupby("model")})
                    here, here_model = per.max(), per.idxmax()
                else:
                    alpha = _alpha(sel)
                    here = alpha if r.claim == "acceptance_mean" else (alpha / (1 - alpha) if alpha < 1 else None)
                here_model = here_model or ",".join(sorted(set(sel["model"])))
        elif r.claim.startswith("batch_") and not batch.empty:
            here, here_model = _batch_claim(r, batch, scale, results)
        quantity = r.claim.replace("_", " ") + (f" vs {method_label(r.baseline)}" if isinstance(r.baseline, str) and r.baseline else "")
        if r.claim.startswith("batch_"):
            quantity += f" (B={r.batch_from}->{r.batch_to})" if r.batch_from != r.batch_to else f" (B={r.batch_to})"
        add(quantity, r.model, r.value, here, r.unit, here_model)
    return pd.DataFrame(rows)


def _alpha(records: pd.DataFrame) -> float:
    """Mean per-token acceptance alpha (the paper's), else accepted / drafted tokens."""
    if "acceptance_alpha" in records and records["acceptance_alpha"].notna().any():
        return float(records["acceptance_alpha"].mean())
    return float(records["accepted_tokens"].sum() / records["drafted_tokens"].sum())


def _batch_claim(r, batch: pd.DataFrame, scale: pd.DataFrame, results: ResultSet):
    fam = {m: results.family(str(m)) for m in batch["model"].unique()}
    if r.claim in ("batch_tpot_ratio", "batch_throughput_ratio", "batch_working_set_ratio"):
        if scale.empty:
            return None, ""
        s = scale[(scale["method"] == r.method) & (scale["model"].map(fam) == r.model)]
        if s.empty:
            return None, ""
        metric = {"batch_tpot_ratio": "tpot_ratio", "batch_throughput_ratio": "throughput_ratio",
                  "batch_working_set_ratio": "working_set_ratio"}[r.claim]
        col = f"{metric}_B2_B1" if r.batch_to == 2 else f"{metric}_Bmax_B1"
        label = s["model"].iloc[0] + ("" if r.batch_to == 2 else f" (B={int(s['B_max'].iloc[0])})")
        return (s[col].iloc[0] if col in s else None), label
    avg = batching.averaged(batch)
    avg = avg[avg["model"].map(fam) == r.model]
    at = avg[avg["batch_size"] == r.batch_to]
    if at.empty and not avg.empty:
        at = avg[avg["batch_size"] == avg["batch_size"].max()]
    if r.method not in set(at["method"]):
        return None, ""
    # the baseline on the method's own hardware, one row per method
    hardware = at.loc[at["method"] == r.method, "hardware"].iloc[0] if "hardware" in at else None
    if hardware is not None:
        at = at[at["hardware"] == hardware]
    a = at.groupby("method").agg({**{c: "mean" for c in ("tpot_ms", "throughput_tok_s") if c in at},
                                  "model": "first", "batch_size": "first"})
    if r.baseline not in a.index:
        return None, ""
    label = f"{a['model'].iloc[0]} (B={int(a['batch_size'].iloc[0])})"
    if r.claim == "batch_tpot_speedup":
        return a.loc[r.baseline, "tpot_ms"] / a.loc[r.method, "tpot_ms"], label
    return a.loc[r.method, "throughput_tok_s"] / a.loc[r.baseline, "throughput_tok_s"], label


def build(results: ResultSet, out: Output) -> None:
    if results.paper is None or not any(results.paper.glob("*.csv")):
        raise Skip("no results/paper/*.csv")
    table = compare(results)
    if table.empty or table["here"].isna().all():
        raise Skip("no measured number matches a paper quantity yet")
    here = setting(results.records("main"))
    out.table(table, NAME, f"Paper (A100 40 GB, real models) vs here ({here})", notes=[
        f"Here = {here}: compare ratios (speedups, K, acceptance), not absolute times. "
        "here_over_paper = here / paper. Paper numbers: results/paper/README.md."])
