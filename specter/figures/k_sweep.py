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
    TIER_ORDER,
    Output,
    Skip,
    legend_above,
    model_label,
    order_models,
    style_axes,
    subplots,
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
    models = order_models(table["model"])
    acc = next((c for c in ACCEPTANCE if c in table.columns and table[c].notna().any()), None)
    has_acc = acc is not None
    fig, axes = subplots(2 if has_acc else 1, len(models), w=3.4, h=2.5, sharex="col")
    series = sorted({(m, h) for m, h in zip(table["memory"], table["hardware"])},
                    key=lambda t: (TIER_ORDER.index(t[0]) if t[0] in TIER_ORDER else len(TIER_ORDER), t))
    colors = {s: TIER_COLORS.get(s[0], EXTRA_COLORS[i % len(EXTRA_COLORS)]) for i, s in enumerate(series)}
    for c, model in enumerate(models):
        for s in series:
            d = table[(table["model"] == model) & (table["memory"] == s[0]) & (table["hardware"] == s[1])]
            if d.empty:
                continue
            color = colors[s]
            ax = axes[0][c]
            ax.plot(d["K"], d["mean_tpot_ms"], marker="o", ms=3.5, color=color, lw=1.4)
            best = d[d["chosen"]]
            ax.scatter(best["K"], best["mean_tpot_ms"], s=140, marker="*", color=color, edgecolors="black",
                       linewidths=0.6, zorder=5)
            edge = str(d["minimum"].iloc[0]).startswith("edge")
            for k, y in zip(best["K"], best["mean_tpot_ms"]):
                right = k == d["K"].max()  # at the right edge: label leftwards, inside the axes
                ax.annotate(f"K={int(k)}" + (" (edge)" if edge else ""), (k, y), textcoords="offset points",
                            xytext=(-6 if right else 0, 8), ha="right" if right else "center", fontsize=7,
                            color=color)
            if has_acc:
                axes[1][c].plot(d["K"], d[acc], marker="o", ms=3.5, color=color, lw=1.4)
                axes[1][c].scatter(best["K"], best[acc], s=140, marker="*", color=color,
                                   edgecolors="black", linewidths=0.6, zorder=5)
        style_axes(axes[0][c], model_label(model).replace(" (", "\n(", 1),
                   ylabel="mean TPOT (ms/token)" if c == 0 else None)
        axes[0][c].title.set_fontsize(9)
        if has_acc:
            style_axes(axes[1][c], None, xlabel="speculation depth K", ylabel=acc.replace("_", " ") if c == 0 else None)
        else:
            axes[0][c].set_xlabel("speculation depth K")
        ks = sorted(table.loc[table["model"] == model, "K"].unique())
        axes[-1][c].set_xticks(ks, [str(int(k)) for k in ks], fontsize=7)
    handles = [Line2D([], [], color=colors[s], marker="o", lw=1.4) for s in series]
    handles.append(Line2D([], [], color="black", marker="*", lw=0, ms=10))
    labels = [f"{m} memory ({h})" if h else f"{m} memory" for m, h in series] + ["chosen K"]
    legend_above(fig, handles, labels)
    fig.tight_layout()
    out.figure(fig, NAME)
