"""Offline K profiling: sweep the speculation depth and keep the K with the lowest mean TPOT.

Following the paper, the expected accepted run before a rejection is E[A] = ᾱ/(1−ᾱ); a measured
ᾱ of ~0.97 motivates K_max = 32 and the sweep K ∈ {2,4,6,8,12,16,20,24,32} over representative
prompts × repeats. Each K is an ordinary resumable run in `<output_dir>/K=<K>/`; the sweep writes
`k_sweep.csv` (one row per K) and `k_profile.json` (the chosen K), which `k_profile=<path>` feeds
back into `method=specter`. `method=specmoeoff` profiles its own K the same way over its own range
(`method.k_range`, which replaces k_sweep.values); its profile names the method, and only
SpecMoEOff reads a profile that does.

A K the memory tier cannot hold (a longer window needs more KV and scratch; SpecMoEOff's separate draft
needs both twice) is refused by the budget before it measures anything: the sweep records it in the
profile's `refused` and profiles the K that fit. Only a sweep in which no K fits fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from specter.assembly.config import ConfigError, load_ratio_of
from specter.records.records import read_records
from specter.assembly.runners import is_method, method_names
from specter.offload.budget import BudgetError
from specter.paths import atomic_write_text, write_table



def sweep_values(cfg: DictConfig) -> list[int]:
    key = "method.k_range" if cfg.method.get("k_range") else "k_sweep.values"
    values = list(cfg.method.k_range if key == "method.k_range" else cfg.k_sweep["values"])
    if not values or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in values):
        raise ConfigError(f"{key} must be integers >= 1, got {values}")
    return sorted(set(values))


def choose_K(table: pd.DataFrame) -> int:
    """The K with the lowest mean TPOT; ties go to the smaller K (less draft work, less scratch)."""
    best = table.sort_values(["mean_tpot_ms", "K"]).iloc[0]
    return int(best.K)


def other_method_in(root: Path, method: str) -> str | None:
    """The method of a K sweep already in `root` when it is not `method` (one folder, one method's sweep)."""
    for config in sorted(root.glob("K=*/config.yaml")):
        try:
            found = str(OmegaConf.load(config).method.name)
        except Exception:  # an unreadable folder is the run's to report
            continue
        if found != method:
            return found
    return None


def profile_k(cfg: DictConfig) -> Path:
    from specter.experiments.run import run

    # the methods whose design tunes K (the registry's `tunes_k`); a method whose config has `k_range` sweeps it
    if not is_method(cfg.method.name, tunes_k=True):
        raise ConfigError(f"a K sweep profiles method={' or method='.join(method_names(tunes_k=True))}, "
                          f"not method={cfg.method.name}")
    root = Path(cfg.output_dir)
    other = other_method_in(root, cfg.method.name)
    if other:
        raise ConfigError(f"{root} holds a K sweep of method={other}; give method={cfg.method.name}'s sweep its own "
                          "output_dir=")
    rows, refused = [], {}
    for K in sweep_values(cfg):
        sub = OmegaConf.merge(cfg, {"K": K, "output_dir": str(root / f"K={K}"), "experiment": "run"})
        try:
            out = run(sub)
        except BudgetError as err:  # refused before measuring: every K is tried, none is assumed not to fit
            refused[K] = str(err)
            print(f"K={K} refused at memory={cfg.memory.name}: {err}")
            continue
        rec = read_records(out / "records.csv")
        rows.append({
            "K": K, "records": len(rec),
            "mean_tpot_ms": rec.tpot_ms.mean(), "median_tpot_ms": rec.tpot_ms.median(),
            "accepted_fraction": rec.accepted_tokens.sum() / rec.drafted_tokens.sum(),
            "acceptance_alpha": rec.acceptance_alpha.mean(),
            "mean_accepted_len": rec.mean_accepted_len.mean(),
            "h2d_mb_per_token": (rec.h2d_bytes / rec.new_tokens).mean() / 1e6,
        })
    if not rows:
        raise BudgetError(f"no K of {sweep_values(cfg)} fits memory={cfg.memory.name}: "
                          + next(iter(refused.values())))
    table = pd.DataFrame(rows)
    write_table(root / "k_sweep.csv", table)
    best = table.loc[table.K == choose_K(table)].iloc[0]
    alpha = float(best.acceptance_alpha)  # α at the chosen K (α differs across K; never averaged over them)
    profile = {
        "model": cfg.model.name, "memory": cfg.memory.name, "hardware": cfg.hardware.name, "method": cfg.method.name,
        "K": int(best.K), "mean_tpot_ms": float(best.mean_tpot_ms),
        "acceptance_alpha": alpha, "expected_accepted_run": alpha / (1 - alpha) if alpha < 1 else None,
        "swept": [int(k) for k in table.K],
        # the minimum at the smallest or largest K swept: the true optimum may lie outside the range
        "at_edge": int(best.K) in (int(table.K.min()), int(table.K.max())) and len(table) > 1,
        # K the tier's budget refused ({K: why}); a minimum at the largest K that fits is bounded by memory
        "refused": {str(k): why for k, why in refused.items()},
    }
    if cfg.hardware.get("link") == "emulated":  # the K holds at this link cost only (config.profiled_k_of checks)
        profile["load_ratio"], profile["load_ratio_source"] = load_ratio_of(cfg)
    try:
        atomic_write_text(root / "k_profile.json", json.dumps(profile, indent=1))
    except OSError as err:
        raise ConfigError(f"cannot write {root / 'k_profile.json'} ({err.strerror or err})") from None
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    edge = " — at the edge of the swept range: widen k_sweep.values to see the minimum" if profile["at_edge"] else ""
    if refused:
        edge += f" (K={','.join(map(str, refused))} refused: the tier's memory does not hold them)"
    print(f"chosen K = {profile['K']} (lowest mean TPOT){edge} -> {root / 'k_profile.json'}")
    return root
