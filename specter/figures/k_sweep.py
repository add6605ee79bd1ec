"""Fig. 7: mean TPOT and acceptance rate against the speculation depth K, per model; chosen K marked.

Input: every `k_sweep.csv` (K, mean_tpot_ms, acceptance_rate, ...) with its `k_profile.json`
(model, memory, hardware, chosen K) beside it. Without the profile the chosen K is the K of lowest
mean TPOT (the paper's rule) and model/memory come from a K=<k>/config.yaml or the folder name
`<model>-<memory>-<hardware>`.

Each sweep says where its minimum lies (`minimum`): "interior" when a swept K on each side has a
higher mean TPOT, else "edge: smallest/largest K swept" — then the chosen K may not be the
tier's best and the range should be widened — unless the K past it were refused by the tier's memory (the
profile's `refused`: a longer window's KV and scratch do not fit), which no range widens: "edge: largest K
the memory tier holds". table_k_used lists, per model, tier and
speculative method, the K its records ran with beside the K the same tier's sweep chose, so a K
taken from another tier's profile (or from a sweep whose minimum is at its edge) shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from specter.assembly.runners import is_method
from specter.figures.common import (
    MODEL_LABELS,
    TIER_ORDER,
    Output,
    Skip,
    caption,
    legend_above,
    model_label,
    order_models,
    style_axes,
    subplots,
    thin_tick_labels,
    wrap,
)
from specter.figures.data import ResultSet

NAME = "fig07_k_sweep"
NAME_USED = "table_k_used"
TITLE = "Fig. 7: K profiling — mean TPOT and acceptance against K (chosen K = lowest mean TPOT)"
TIER_COLORS = {"high": "#0072B2", "low": "#D55E00"}
EXTRA_COLORS = ("#009E73", "#CC79A7", "#E69F00", "#56B4E9")
# per-token acceptance alpha (the paper's alpha), else accepted / drafted tokens (older sweeps: acceptance_rate)
ACCEPTANCE = ("acceptance_alpha", "accepted_fraction", "acceptance_rate")


def sweep_info(results: ResultSet, path: Path, df: pd.DataFrame) -> dict:
    folder = path.parent
    profile = folder / "k_profile.json"
    info: dict = json.loads(profile.read_text()) if profile.exists() else {}
    if not info.get("model"):
        sub = sorted(folder.glob("K=*/config.yaml"))
        if sub:
            info.update({k: v for k, v in results.run_info(sub[0].parent).items() if v and k in ("model", "memory", "hardware")})
    if not info.get("model"):
        parts = folder.name.rsplit("-", 2)
        info.update(dict(zip(("model", "memory", "hardware"), parts)) if len(parts) == 3 else {"model": folder.name})
    if "K" not in info:
        info["K"] = int(df.loc[df["mean_tpot_ms"].idxmin(), "K"])
    return info


def _sweeps(results: ResultSet, quiet: bool = False) -> list[tuple[dict, pd.DataFrame]]:
    """Every K sweep of the set with its profile's facts (`sweep_info`), Specter's and other methods' own."""
    found = []
    for path, df in results.csvs("k_sweep.csv"):
        if not {"K", "mean_tpot_ms"} <= set(df.columns):
            if not quiet:
                print(f"note: {path} lacks K/mean_tpot_ms; ignored")
            continue
        found.append((sweep_info(results, path, df), df))
    return found


def sweep_table(results: ResultSet) -> pd.DataFrame:
    frames = []
    for info, df in _sweeps(results):
        if info.get("method", "specter") != "specter":  # another method's own K profile (SpecMoEOff's range)
            continue
        df = df.assign(model=info.get("model"), memory=info.get("memory") or "", hardware=info.get("hardware") or "",
                       chosen=df["K"] == info["K"], refused=",".join(sorted(info.get("refused") or {}, key=int)))
        frames.append(df)
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    table["minimum"] = ""
    for _, g in table.groupby(["model", "memory", "hardware"], sort=False):
        table.loc[g.index, "minimum"] = minimum_at(g, refused_of(g))
    lead = ["model", "memory", "hardware", "K", "chosen", "mean_tpot_ms", "minimum", "refused"]
    cols = lead + [c for c in ("median_tpot_ms", "mean_tpot_fair_ms", *ACCEPTANCE, "mean_accepted_len",
                               "h2d_mb_per_token", "records") if c in table.columns]
    table["_m"] = table["model"].map({m: i for i, m in enumerate(order_models(table["model"]))})
    return table.sort_values(["_m", "memory", "hardware", "K"])[cols].reset_index(drop=True)


def refused_of(group: pd.DataFrame) -> list[int]:
    """The K a sweep's profile says its memory tier refused (the `refused` column sweep_table adds)."""
    if "refused" not in group.columns or group.empty:
        return []
    return [int(k) for k in str(group["refused"].iloc[0]).split(",") if k.strip()]


def minimum_at(sweep: pd.DataFrame, refused=()) -> str:
    """Where one sweep's lowest mean TPOT lies: "interior", "edge: smallest/largest K swept (K=k)", or
    "edge: largest K the memory tier holds" when the tier refused every larger K it was asked for."""
    d = sweep.dropna(subset=["mean_tpot_ms"]).sort_values("K")
    refused = sorted(int(k) for k in refused)
    if refused and len(d) and int(d.loc[d["mean_tpot_ms"].idxmin(), "K"]) == int(d["K"].iloc[-1]) \
            and refused[0] > int(d["K"].iloc[-1]):
        return (f"edge: largest K the memory tier holds (K={int(d['K'].iloc[-1])}; "
                f"K={','.join(map(str, refused))} refused)")
    if len(d) < 3:
        return f"edge: only {len(d)} K swept"
    best = int(d.loc[d["mean_tpot_ms"].idxmin(), "K"])
    if best == int(d["K"].iloc[0]):
        return f"edge: smallest K swept (K={best})"
    if best == int(d["K"].iloc[-1]):
        return f"edge: largest K swept (K={best})"
    return "interior"


def chosen_profiles(results: ResultSet) -> dict[tuple[str, str, str], tuple[int, str]]:
    """(model, memory, method) -> (chosen K, where the minimum lies) of every K profile in the set:
    Specter's (which MoE-Spec shares) and a method's own (SpecMoEOff's, over its own K range)."""
    return {(str(info.get("model")), str(info.get("memory") or ""), str(info.get("method") or "specter")):
            (int(info["K"]), minimum_at(df, info.get("refused") or ())) for info, df in _sweeps(results, quiet=True)}




def profile_of(profiles: dict, model: str, memory: str, method: str) -> tuple[int | None, str]:
    """The profile a run of `method` reads: its own, else Specter's; its tier's, else the model's other
    swept tier (QUICK and REFERENCE sweep the low tier only, and both tiers use it)."""
    if any(k[2] == method for k in profiles):
        owner = method
    elif is_method(method, reads_specter_profile=True):  # Specter's k_profile= applies to it
        owner = "specter"
    else:  # e.g. SpecMoEOff's artifact preset: its K is fixed, it reads no profile
        return None, "reads no K profile (fixed K)"
    if (model, memory, owner) in profiles:
        K, where = profiles[(model, memory, owner)]
        return K, f"{owner}'s profile: {where}"
    for (m, tier, o), (K, where) in sorted(profiles.items()):
        if m == model and o == owner:
            return K, f"{owner}'s profile of the {tier} tier: {where}"
    return None, "no sweep for this model"


def k_used_table(results: ResultSet) -> pd.DataFrame:
    """Per (model, tier, hardware, speculative method): the K in its records and the K of the profile it reads."""
    records = results.records("main")
    if records.empty or "K" not in records.columns:
        return pd.DataFrame()
    spec = records[records["K"].notna()]
    if spec.empty:
        return pd.DataFrame()
    profiles = chosen_profiles(results)
    rows = []
    for (model, memory, hardware, method), g in spec.groupby(["model", "memory", "hardware", "variant"], sort=False):
        ks = sorted({int(k) for k in g["K"]})
        K, where = profile_of(profiles, str(model), str(memory), str(method).split("[", 1)[0])
        rows.append({"model": model, "memory": memory, "hardware": hardware, "method": method,
                     "K_in_records": ",".join(map(str, ks)),
                     "records_without_K": int(records[(records["model"] == model) & (records["memory"] == memory)
                                                      & (records["variant"] == method)]["K"].isna().sum()),
                     "profile_K": K, "profile": where})
    return pd.DataFrame(rows)


def build(results: ResultSet, out: Output) -> None:
    table = sweep_table(results)
    used = k_used_table(results)
    if not used.empty:
        out.table(used, NAME_USED, "K used by each speculative method, beside its own tier's profile", notes=[
            "K_in_records: the K every record of that run carries; profile_K: the K of the profile the method reads "
            "(its own, else Specter's; its tier's, else the model's swept tier); profile: whose, and whether that "
            "sweep's minimum is interior or at an edge. A method without a profile (the artifact preset) runs its fixed K."])
    if table.empty:
        raise Skip("no k_sweep.csv (python run.py experiment=k_sweep ...)")
    out.table(table, NAME, TITLE, notes=["chosen: the K that k_profile.json recorded (lowest mean TPOT). minimum: "
                                         "interior, or at an edge of the swept range (then widen the range; a K past the largest one the memory "
                                         "tier holds is listed in refused and cannot be widened into)."])
    _figure(results, table, out)


def paper_k(results: ResultSet) -> dict[str, int]:
    """The paper's chosen K per real model (results/paper/k_profile.csv), {} without the file."""
    path = results.paper / "k_profile.csv" if results.paper is not None else None
    if path is None or not path.is_file():
        return {}
    df = pd.read_csv(path)
    return {str(m): int(k) for m, k in zip(df["model"], df["K"])} if {"model", "K"} <= set(df.columns) else {}


def sweep_basis(results: ResultSet) -> str:
    """What the sweeps measured, from their K=<k> runs' config.yaml: datasets, prompts, repeats, new tokens,
    hardware ("" when no run folder is there to say)."""
    seen = []
    for path, _ in results.csvs("k_sweep.csv"):
        runs = sorted(path.parent.glob("K=*/config.yaml"))
        if not runs:
            continue
        cfg = results.config(runs[0].parent)
        name = lambda key: (cfg.get(key) or {}).get("name") if isinstance(cfg.get(key), dict) else cfg.get(key)
        if name("method") not in (None, "specter"):  # another method's own profile: not drawn (sweep_table)
            continue
        parts = [f"{str(name('dataset')).replace(',', ', ')} prompts" if name("dataset") else None,
                 f"{cfg['num_prompts']} prompts per dataset" if cfg.get("num_prompts") else None,
                 f"{cfg['repeats']} repeat(s)" if cfg.get("repeats") else None,
                 f"{cfg['max_new_tokens']} new tokens each" if cfg.get("max_new_tokens") else None,
                 f"hardware: {name('hardware')}" if name("hardware") else None]
        basis = ", ".join(p for p in parts if p)
        if basis and basis not in seen:
            seen.append(basis)
    return "; ".join(seen)


def _chosen_line(table: pd.DataFrame, model: str) -> str:
    """'chosen K: high 32, low 64 (edge)' for one model's sweeps."""
    chosen = []
    for (tier, hardware), d in table[table["model"] == model].groupby(["memory", "hardware"], sort=False):
        best = d[d["chosen"]]
        if best.empty:
            continue
        edge = " (edge)" if str(d["minimum"].iloc[0]).startswith("edge") else ""
        chosen.append((TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), f"{tier} "
                       f"{int(best['K'].iloc[0])}{edge}"))
    return "chosen K: " + ", ".join(c for _, c in sorted(chosen)) if chosen else ""


def _figure(results: ResultSet, table: pd.DataFrame, out: Output) -> None:
    models = order_models(table["model"])
    acc = next((c for c in ACCEPTANCE if c in table.columns and table[c].notna().any()), None)
    has_acc = acc is not None
    fig, axes = subplots(2 if has_acc else 1, len(models), w=3.4, h=2.5, sharex="col")
    series = sorted({(m, h) for m, h in zip(table["memory"], table["hardware"])},
                    key=lambda t: (TIER_ORDER.index(t[0]) if t[0] in TIER_ORDER else len(TIER_ORDER), t))
    colors = {s: TIER_COLORS.get(s[0], EXTRA_COLORS[i % len(EXTRA_COLORS)]) for i, s in enumerate(series)}
    papers = paper_k(results)
    for c, model in enumerate(models):
        for s in series:
            d = table[(table["model"] == model) & (table["memory"] == s[0]) & (table["hardware"] == s[1])]
            if d.empty:
                continue
            color = colors[s]
            best = d[d["chosen"]]
            rows = [(axes[0][c], "mean_tpot_ms")] + ([(axes[1][c], acc)] if has_acc else [])
            for ax, column in rows:
                ax.plot(d["K"], d[column], marker="o", ms=3.5, color=color, lw=1.4)
                ax.scatter(best["K"], best[column], s=140, marker="*", color=color, edgecolors="black",
                           linewidths=0.6, zorder=5)
        # the chosen K in words in the title, not beside its star: two tiers' stars often share a K or sit
        # a few pixels apart, and their labels printed over each other and over the tick labels
        family = results.family(str(model))
        paper = papers.get(family)
        lines = [model_label(model), _chosen_line(table, model)]
        if paper is not None:
            lines.append(f"paper's K ({MODEL_LABELS.get(family, family)}): {paper}")
            for ax in axes[:, c]:
                ax.axvline(paper, color="#555555", lw=1.0, ls="--", zorder=1)
        style_axes(axes[0][c], wrap("\n".join(l for l in lines if l), fig.get_figwidth() / len(models) - 0.5, 9),
                   ylabel="mean TPOT (ms/token)" if c == 0 else None)
        axes[0][c].title.set_fontsize(9)
        if has_acc:
            style_axes(axes[1][c], None, xlabel="speculation depth K", ylabel=acc.replace("_", " ") if c == 0 else None)
        else:
            axes[0][c].set_xlabel("speculation depth K")
        ks = sorted(table.loc[table["model"] == model, "K"].unique())
        # every swept K ticked; K=4 and K=8 sit a few pixels apart, so thin_tick_labels (below) blanks a crowded label
        axes[-1][c].set_xticks(ks, [str(int(k)) for k in ks], fontsize=7)
    handles = [Line2D([], [], color=colors[s], marker="o", lw=1.4) for s in series]
    handles.append(Line2D([], [], color="black", marker="*", lw=0, ms=10))
    labels = [f"{m} memory ({h})" if h else f"{m} memory" for m, h in series] + ["chosen K (lowest mean TPOT)"]
    if papers:
        handles.append(Line2D([], [], color="#555555", lw=1.0, ls="--"))
        labels.append("the paper's chosen K for the real model (Fig. 7)")
    legend_above(fig, handles, labels, ncol=4)
    fig.tight_layout()
    thin_tick_labels(fig, [ax.xaxis for ax in axes[-1]])
    basis = sweep_basis(results)
    records = pd.to_numeric(table.get("records"), errors="coerce").dropna() if "records" in table else pd.Series()
    per_k = (f"{int(records.min())}" if records.min() == records.max() else
             f"{int(records.min())}-{int(records.max())}") if len(records) else "the"
    caption(fig, f"Measured: the mean TPOT of {per_k} records per K (mean_tpot_ms of k_sweep.csv; one record = one "
                 f"prompt's decode) and their acceptance{f' ({acc})' if acc else ''}" + (f"; {basis}" if basis else "")
            + ". (edge): the lowest mean sits at an edge of the swept range (or at the largest K the tier holds).")
    out.figure(fig, NAME)
