"""A verdict per model x memory tier: is Specter the fastest lossless offloading method, and why.

Two verdicts, each with its reason in numbers:

CPU         from the records (the tiny proxy on the calibrated emulated link): Specter's prompt-level paired
            speedup (`headline.paired_table`: median over prompts of TPOT(rival)/TPOT(specter), percentile-
            bootstrap 95 % CI over prompts) against every lossless offloading rival measured in the cell on
            Specter's hardware.
              fastest            the CI lies above 1 against every rival
              not demonstrated   no CI below 1, but at least one holds 1 (those rivals are named)
              slower than X      the CI lies below 1 against X
            A side counts only where the intervals of every seed in tpot_grid.CI_CHECK_SEEDS agree
            (headline's `ci_side`); one that moves with the seed holds 1.
            Reason: Specter's expert loads per token (H2D bytes / one expert's bytes / new tokens), accepted
            fraction of K (accepted / drafted tokens, the quantity the projection calls acceptance) with α
            beside it, and slots (M+S: resident experts per layer + staging buffers) beside the same numbers
            of the closest rival (the lowest paired speedup).
projection  from projection.csv (`python run.py experiment=project`, the real model on the paper's A100; found
            as `specter.figures.projection.projections` finds it): Specter's profiled-K row (its only row when
            no K was profiled) against each rival's best row (lowest projected TPOT over its K rows). A
            projection is deterministic: there is no interval, only faster or not. Reason: TPOT, loads per
            token, accepted fraction of K, M+S of Specter and of the fastest rival, the paper's TPOT of that rival where
            published, and what Specter's Belady bound (`specter_belady_loads_per_token`: the fewest loads per
            token any residency policy could reach at Specter's slots and windows) says: a floor of bound x
            one expert's H2D at or above the rival's TPOT means the cell cannot be won by residency.

Rivals: every method but Specter itself (and its variants), target_only (every expert resident: not offloading)
and lossy methods (token match with target_only below 1, or lossy by design: the registry's `lossy`). Tiny proxies
map to the real models they mirror (`common.REAL_OF_TINY`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from specter.assembly.runners import is_method
from specter.figures.common import REAL_OF_TINY, base_method, method_label, order_models, order_tiers
from specter.figures.labels import is_lossy as lossy_by_design
from specter.records.paired import flagged_mask, prompt_medians

REFERENCE = "specter"
NO_PROJECTION = "no projection in the results"
NO_RECORDS = "no CPU records of Specter and a lossless offloading rival"
DEVICE = "a100_40gb_pcie4"  # the paper's machine
TINY_OF_REAL = {real: tiny for tiny, real in REAL_OF_TINY.items()}


def is_rival(method: str, lossy: bool = False) -> bool:
    """A lossless offloading method other than Specter."""
    base = base_method(method)
    all_resident = is_method(base, slots_rule="all")  # every expert on the device: no offloading rival
    return base != REFERENCE and not all_resident and not lossy and not lossy_by_design(base)


def _num(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def _fmt(x, digits: int = 2) -> str:
    v = _num(x)
    return "n/a" if math.isnan(v) else f"{v:.{digits}f}"


def _ci(row) -> str:
    return f"{row.speedup:.2f} [{row.ci_low:.2f}, {row.ci_high:.2f}]"


# ---------------------------------------------------------------- CPU (records)


def expert_bytes(records: pd.DataFrame) -> float:
    """One expert's bytes: a staging buffer holds one expert (staging_bytes / staging_buffers); NaN when no record
    of the model says."""
    if not {"staging_bytes", "staging_buffers"} <= set(records.columns):
        return float("nan")
    b = pd.to_numeric(records["staging_bytes"], errors="coerce")
    n = pd.to_numeric(records["staging_buffers"], errors="coerce")
    per = (b / n.where(n > 0)).dropna()
    return float(per.median()) if len(per) else float("nan")


def method_facts(records: pd.DataFrame, method: str, one_expert: float) -> dict:
    """Loads per token (median over prompts of the median over repeats), acceptance, K and M+S of one method's
    unflagged records in a cell."""
    r = records[records["variant"] == method]
    facts = {"loads_per_token": float("nan"), "h2d_mb_per_token": float("nan"), "acceptance": float("nan"),
             "accepted": float("nan"), "K": float("nan"), "slots": "n/a"}
    if r.empty:
        return facts
    if {"h2d_bytes", "new_tokens"} <= set(r.columns):
        tokens = pd.to_numeric(r["new_tokens"], errors="coerce")
        per_token = pd.to_numeric(r["h2d_bytes"], errors="coerce") / tokens.where(tokens > 0)
        per_prompt = prompt_medians(r.assign(h2d_per_token=per_token), "h2d_per_token")
        if len(per_prompt):
            facts["h2d_mb_per_token"] = float(per_prompt.median()) / 1e6
            if one_expert > 0:
                facts["loads_per_token"] = float(per_prompt.median()) / one_expert
    for col, key in (("acceptance_alpha", "acceptance"), ("accepted_fraction", "accepted"), ("K", "K")):
        if col in r.columns:
            v = pd.to_numeric(r[col], errors="coerce").dropna()
            if len(v):
                facts[key] = float(v.median())
    if "resident_experts" in r.columns:
        m = pd.to_numeric(r["resident_experts"], errors="coerce").dropna()
        s = pd.to_numeric(r.get("staging_buffers", pd.Series(dtype=float)), errors="coerce").dropna()
        if len(m):
            facts["slots"] = f"{int(m.median())}+{int(s.median()) if len(s) else 0}"
    return facts


def _facts_text(name: str, f: dict) -> str:
    spec = ""
    k = f"K={int(f['K'])}" if not math.isnan(f["K"]) else "K"
    if not math.isnan(f.get("accepted", float("nan"))):  # the projection's acceptance: accepted / drafted
        spec = f", accepted {f['accepted']:.2f} of {k}"
        if not math.isnan(f["acceptance"]):
            spec += f" (α {f['acceptance']:.2f})"
    elif not math.isnan(f["acceptance"]):
        spec = f", α {f['acceptance']:.2f}" + (f" at {k}" if k != "K" else "")
    io = (f"{f['loads_per_token']:.2f} loads/token" if not math.isnan(f["loads_per_token"]) else
          f"H2D {f['h2d_mb_per_token']:.3g} MB/token (one expert's bytes not recorded)"
          if not math.isnan(f["h2d_mb_per_token"]) else "loads/token not recorded")
    return f"{name}: {io}{spec}, M+S {f['slots']}"


def _sides(rivals: pd.DataFrame) -> pd.Series:
    """headline's `ci_side` per rival (above / below / holds / unstable), or the side of its one interval."""
    if "ci_side" in rivals.columns:
        return rivals["ci_side"].fillna("holds").astype(str)
    return pd.Series(["above" if lo > 1 else "below" if hi < 1 else "holds"
                      for lo, hi in zip(rivals["ci_low"], rivals["ci_high"])], index=rivals.index, dtype=object)


def cpu_verdicts(paired: pd.DataFrame, records: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, memory, hardware) where Specter and a lossless offloading rival were paired:
    cpu_verdict ('fastest', 'not demonstrated', 'slower than X'), cpu_reason, and the closest rival's numbers.

    `paired`: headline.paired_table (or headline_table; ALL rows ignored) with a `lossy` column when known;
    `records`: the cells' records (flagged ones are left out here as in the pairing)."""
    rows = []
    if paired.empty:
        return pd.DataFrame(rows)
    cells = paired[paired["model"] != "ALL"]
    clean = records[~flagged_mask(records)] if not records.empty else records
    for (model, memory, hardware), g in cells.groupby(["model", "memory", "hardware"], sort=False):
        lossy = g["lossy"].fillna(False).astype(bool) if "lossy" in g.columns else pd.Series(False, index=g.index)
        rivals = g[[is_rival(m, lo) for m, lo in zip(g["method"], lossy)]]
        if rivals.empty:
            continue
        side = _sides(rivals)
        below = rivals[side == "below"]
        holds = rivals[side.isin(["holds", "unstable"])]  # an interval whose side moves with the seed holds 1
        closest = rivals.loc[rivals["speedup"].idxmin()]
        if len(below):
            verdict = "slower than " + ", ".join(below["method"])
            why = "CI below 1 against " + "; ".join(f"{r.method} {_ci(r)}" for r in below.itertuples())
        elif len(holds):
            verdict = "not demonstrated"
            why = "CI holds 1 against " + "; ".join(f"{r.method} {_ci(r)}" for r in holds.itertuples())
        else:
            verdict = "fastest"
            why = f"CI above 1 against all {len(rivals)} rivals; closest {closest['method']} {_ci(closest)}"
        cell = clean[(clean["model"] == model) & (clean["memory"] == memory)] if not clean.empty else clean
        if "hardware" in cell.columns and not cell.empty:
            cell = cell[cell["hardware"].fillna("unknown").astype(str) == str(hardware)]
        one = expert_bytes(clean[clean["model"] == model]) if not clean.empty else float("nan")
        spec = method_facts(cell, REFERENCE, one) if not cell.empty else method_facts(pd.DataFrame(), "", one)
        rival = method_facts(cell, closest["method"], one) if not cell.empty else spec
        reason = (f"{why}. {_facts_text('Specter', spec)}; {_facts_text(str(closest['method']), rival)} "
                  f"(prompts {int(closest['prompts'])})")
        rows.append({"model": model, "memory": memory, "hardware": hardware, "cpu_verdict": verdict,
                     "cpu_rivals": len(rivals), "cpu_closest_rival": closest["method"],
                     "cpu_closest_speedup": float(closest["speedup"]), "cpu_closest_ci_low": float(closest["ci_low"]),
                     "cpu_closest_ci_high": float(closest["ci_high"]),
                     "specter_loads_per_token": spec["loads_per_token"], "rival_loads_per_token": rival["loads_per_token"],
                     "specter_acceptance": spec["acceptance"], "specter_K": spec["K"], "specter_slots": spec["slots"],
                     "rival_slots": rival["slots"], "cpu_reason": reason})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- projection (projection.csv)


def _slots(row) -> str:
    for col in ("M+S", "slots"):
        if col in row.index and str(row[col]) not in ("", "nan"):
            return str(row[col])
    m, s = _num(row.get("resident")), _num(row.get("staging"))
    if math.isnan(m):
        return "n/a"
    return f"{int(m)}+{0 if math.isnan(s) else int(s)}"


def _acceptance(row) -> float:
    for col in ("acceptance", "accept"):
        if col in row.index:
            v = _num(row[col])
            if not math.isnan(v):
                return v
    return float("nan")


def h2d_ms(cell: pd.DataFrame) -> float:
    """One expert's H2D on the modelled link, from the rows themselves: on the virtual clock the copy stream is busy
    loads/token x H2D per token, so H2D = TPOT x copy_busy / loads_per_token (the median over the cell's rows)."""
    t = pd.to_numeric(cell["tpot_ms"], errors="coerce")
    busy = pd.to_numeric(cell.get("copy_busy", pd.Series(np.nan, index=cell.index)), errors="coerce")
    loads = pd.to_numeric(cell.get("loads_per_token", pd.Series(np.nan, index=cell.index)), errors="coerce")
    est = (t * busy / loads.where(loads > 0)).dropna()
    return float(est.median()) if len(est) else float("nan")


def _row_text(name: str, row) -> str:
    acc = _acceptance(row)
    K = str(row.get("K", "")).strip().removesuffix(".0")  # pandas reads a column with blanks as floats
    src = f" {row.get('k_source')}" if str(row.get("k_source", "")) not in ("", "nan") else ""
    k = f"K={K}{src}" if K not in ("", "nan") else ""
    # the projection's acceptance is accepted / drafted tokens: the same quantity as the CPU's accepted_fraction
    acc_text = f", accepted {acc:.2f} of {k or 'K'}" if not math.isnan(acc) else (f" at {k}" if k else "")
    return (f"{name} {_fmt(row['tpot_ms'])} ms, {_fmt(row.get('loads_per_token'))} loads/token"
            + acc_text + f", M+S {_slots(row)}")


def bound_text(spec, best, cell: pd.DataFrame) -> tuple[str, str]:
    """(short, sentence) on Specter's Belady bound against the fastest rival."""
    bound = _num(spec.get("specter_belady_loads_per_token"))
    if math.isnan(bound):
        bound = _num(spec.get("belady_loads_per_token"))
    if math.isnan(bound):
        return "bound not recorded", "Specter's Belady bound is not in this projection.csv"
    rival_loads, rival_tpot = _num(best.get("loads_per_token")), _num(best["tpot_ms"])
    h2d = h2d_ms(cell)
    if not math.isnan(h2d):
        floor = bound * h2d
        text = (f"Specter's Belady bound {bound:.2f} loads/token x {h2d:.3f} ms H2D = floor {floor:.2f} ms")
        if floor >= rival_tpot:
            return "cannot be won by residency", f"{text} >= {best['method']}'s {rival_tpot:.2f} ms: cannot be won by residency"
        text += f" < {best['method']}'s {rival_tpot:.2f} ms"
    else:
        text = f"Specter's Belady bound {bound:.2f} loads/token (H2D unknown: no copy_busy)"
    if not math.isnan(rival_loads) and bound > rival_loads:
        return ("bound above rival's loads", f"{text}; the bound is above {best['method']}'s {rival_loads:.2f} "
                "loads/token, so only the rival's idle copy time leaves room")
    return "room to win by residency", f"{text}; residency leaves room to win"


def _paper_text(spec, best) -> str:
    """What the paper's own TPOTs say beside the projection: its TPOT for the fastest rival (and for Specter)."""
    rival, ours = _num(best.get("paper_tpot_ms")), _num(spec.get("paper_tpot_ms"))
    name = method_label(best["method"])
    if math.isnan(rival) or not best["tpot_ms"] > 0:
        return ""
    text = f"; the paper's {name} TPOT {rival:.1f} ms is {rival / best['tpot_ms']:.2f}x this projection's"
    if not math.isnan(ours) and ours > 0:
        text += f" (the paper: Specter {ours:.1f} ms, {rival / ours:.2f}x faster than its {name})"
    return text


def projection_verdicts(proj: pd.DataFrame | None, device: str = DEVICE) -> pd.DataFrame:
    """One row per (real model, memory) of the projection on `device`: projection_verdict ('fastest' or 'slower
    than X'), projection_reason, and the numbers behind it. Empty when there is no projection."""
    rows = []
    if proj is None or proj.empty:
        return pd.DataFrame(rows)
    df = proj[proj["device"].astype(str) == device] if "device" in proj.columns else proj
    for (model, memory), cell in df.groupby(["model", "memory"], sort=False):
        cell = cell.assign(tpot_ms=pd.to_numeric(cell["tpot_ms"], errors="coerce")).dropna(subset=["tpot_ms"])
        spec_rows = cell[cell["method"] == REFERENCE]
        if spec_rows.empty:
            continue
        ks = spec_rows.get("k_source", pd.Series("", index=spec_rows.index)).fillna("").astype(str)
        profiled = spec_rows[ks == "profiled"]
        spec = (profiled if len(profiled) else spec_rows).sort_values("tpot_ms").iloc[0]
        rivals = cell[[is_rival(m) for m in cell["method"]]]
        if rivals.empty:
            continue
        best_of = rivals.sort_values("tpot_ms").drop_duplicates("method")  # each rival's best row
        best = best_of.iloc[0]
        slower = best_of[best_of["tpot_ms"] <= spec["tpot_ms"]]
        verdict = "fastest" if slower.empty else "slower than " + ", ".join(slower["method"])
        short, bound = bound_text(spec, best, cell)
        paper_text = _paper_text(spec, best)
        k_note = ("" if len(profiled) else " (K source not recorded)" if not ks.any() else
                  f" (no profiled-K row: its {spec.get('k_source')}-K row)")
        reason = (f"{_row_text('Specter', spec)}{k_note}; fastest rival {_row_text(str(best['method']), best)}; "
                  f"{bound}{paper_text}")
        rows.append({"model": model, "memory": memory, "projection_verdict": verdict,
                     "projection_best_rival": best["method"], "specter_tpot_ms": float(spec["tpot_ms"]),
                     "rival_tpot_ms": float(best["tpot_ms"]),
                     "projection_specter_over_rival": float(spec["tpot_ms"]) / float(best["tpot_ms"]),
                     "projection_bound": short, "projection_reason": reason})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- one table


def verdict_table(cpu: pd.DataFrame, projected: pd.DataFrame) -> pd.DataFrame:
    """One row per model x tier (the tiny proxy and the real model it mirrors on one row): the CPU verdict and the
    projection verdict with their reasons; a side with nothing to judge says so."""
    keys: dict[tuple[str, str], dict] = {}
    for r in (cpu.to_dict("records") if not cpu.empty else []):
        real = REAL_OF_TINY.get(r["model"], r["model"])
        keys.setdefault((real, r["memory"]), {})["cpu"] = r
    for r in (projected.to_dict("records") if not projected.empty else []):
        keys.setdefault((r["model"], r["memory"]), {})["proj"] = r
    rows = []
    for real in order_models({k[0] for k in keys}):
        for memory in order_tiers({k[1] for k in keys if k[0] == real}):
            got = keys[(real, memory)]
            c, p = got.get("cpu"), got.get("proj")
            rows.append({"model": real, "proxy": c["model"] if c else TINY_OF_REAL.get(real, ""), "memory": memory,
                         "cpu_verdict": c["cpu_verdict"] if c else "no CPU records",
                         "projection_verdict": p["projection_verdict"] if p else "no projection",
                         "cpu_reason": c["cpu_reason"] if c else NO_RECORDS,
                         "projection_reason": p["projection_reason"] if p else NO_PROJECTION})
    return pd.DataFrame(rows, columns=["model", "proxy", "memory", "cpu_verdict", "projection_verdict", "cpu_reason",
                                       "projection_reason"])


def headline_columns(table: pd.DataFrame, verdicts: pd.DataFrame) -> pd.DataFrame:
    """The headline table with each cell's two verdicts on its rows (ALL rows: empty)."""
    if verdicts.empty or table.empty:
        return table.assign(cpu_verdict="", projection_verdict="")
    by = {}
    for r in verdicts.itertuples(index=False):
        by[(r.model, r.memory)] = r
        if r.proxy:
            by[(r.proxy, r.memory)] = r
    cpu, proj = [], []
    for model, memory in zip(table["model"], table["memory"]):
        r = by.get((model, memory))
        cpu.append(r.cpu_verdict if r is not None else "")
        proj.append(r.projection_verdict if r is not None else "")
    return table.assign(cpu_verdict=cpu, projection_verdict=proj)
