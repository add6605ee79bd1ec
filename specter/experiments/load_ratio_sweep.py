"""`experiment=load_ratio_sweep`: TPOT of each method against the emulated link's load ratio r.

r = (one expert load over the link) / (one layer's decode step). Speculation and prefetch hide
loads while there is compute to hide them behind, so Specter's advantage over on-demand
offloading depends on r: this sweep measures where it comes from and where it ends. The paper's
hardware sits near r ≈ 0.7 (DeepSeek-V2-Lite, Qwen1.5-MoE) and r ≈ 6 (Phi-3.5-MoE) on an A100
over PCIe 4.0; a reader on other hardware can place their own r on the same axis.

For each model (`load_ratio_sweep.models`, null = the run's model), each tier
(`load_ratio_sweep.tiers`) and each r (`load_ratio_sweep.ratios`), every method
(`load_ratio_sweep.methods`) is an ordinary resumable run in
`<output_dir>/<model>/<tier>/r=<r>/<method>/` with `model.load_ratio=r`, the methods of one r run
back to back. `target_only` uses no link, so it runs once per model (`<output_dir>/<model>/target_only/`)
and is the same reference at every r. One row per (model, tier, r, method) goes to
`<output_dir>/load_ratio.csv`, with the effective ratio the records actually ran under; sweeps of
other models, tiers or methods into the same folder add their rows to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from specter.assembly.config import ConfigError
from specter.assembly.load_ratio import ratio_summary
from specter.assembly.runners import is_method

TABLE = "load_ratio.csv"


def linkless(method: str) -> bool:
    """A method that keeps every expert on the device (slots rule "all"): no link, one run per model."""
    return is_method(method, slots_rule="all")


def sweep_settings(cfg: DictConfig) -> tuple[list[str], list[str], list[float], list[str]]:
    """(models, tiers, ratios, methods) of the sweep, checked."""
    s = cfg.load_ratio_sweep
    models = list(s.models) if s.get("models") else [cfg.model.name]
    tiers = list(s.tiers)
    ratios = sorted({float(r) for r in s.ratios})
    methods = list(s.methods)
    if not (models and tiers and ratios and methods):
        raise ConfigError("load_ratio_sweep needs at least one model, tier, ratio and method")
    if any(not r > 0 for r in ratios):
        raise ConfigError(f"load_ratio_sweep.ratios must all be > 0, got {list(s.ratios)}")
    if cfg.hardware.link != "emulated":
        raise ConfigError(f"load_ratio_sweep sets the emulated link's ratio: use hardware=emulated, not hardware={cfg.hardware.name}")
    if cfg.hardware.get("bandwidth_gbps"):
        raise ConfigError("load_ratio_sweep sets the link from each ratio; drop hardware.bandwidth_gbps")
    return models, tiers, ratios, methods


NAMED_POINTS = ("legacy", "device")


def named_ratios(cfg: DictConfig, model: str) -> dict[float, str]:
    """The named points of `load_ratio_sweep.points` for one model, ratio -> name: `legacy` (the hand
    estimate the emulated link used before: 0.7, or 6 for Phi) and `device` (the cost model of the real
    model on hardware.device_model, what a run with no model.load_ratio emulates)."""
    from specter.projection.link_ratio import DEFAULT_DEVICE, LEGACY_ESTIMATE, link_ratio

    points = list(cfg.load_ratio_sweep.get("points") or [])
    unknown = [p for p in points if p not in NAMED_POINTS]
    if unknown:
        raise ConfigError(f"load_ratio_sweep.points: unknown {unknown}; choose from {list(NAMED_POINTS)}")
    if not points:
        return {}
    node = _group("model", model) if model != cfg.model.name else cfg.model
    real = str(node.get("real") or model)
    device = str(cfg.hardware.get("device_model") or DEFAULT_DEVICE)
    out: dict[float, str] = {}
    if "legacy" in points and real in LEGACY_ESTIMATE:
        out[LEGACY_ESTIMATE[real]] = "legacy estimate"
    if "device" in points:
        out[round(link_ratio(real, device).ratio, 3)] = device
    return out


def ratio_label(r: float) -> str:
    """Folder name of one ratio: r=0.25, r=1, r=8."""
    return f"r={r:g}"


def _group(name: str, option: str) -> DictConfig:
    from specter.assembly.compose import compose

    try:
        return getattr(compose([f"{name}={option}"]), name)
    except Exception as err:  # noqa: BLE001 - Hydra's own message names the missing option
        raise ConfigError(f"load_ratio_sweep: cannot compose {name}={option} ({str(err).splitlines()[0]})") from None


def cell_config(cfg: DictConfig, model: str, tier: str, method: str, ratio: float | None, out: Path) -> DictConfig:
    """`cfg` as `model=<model> memory=<tier> method=<method> model.load_ratio=<ratio>` would compose it."""
    sub = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(sub):
        if model != cfg.model.name:
            node = _group("model", model)
            node.trained = bool(cfg.model.get("trained"))
            sub.model = node
        if tier != cfg.memory.name:
            sub.memory = _group("memory", tier)
        if method != cfg.method.name:
            sub.method = _group("method", method)
        if ratio is not None:
            sub.model.load_ratio = float(ratio)
        sub.experiment = "run"
        sub.output_dir = str(out)
    return sub


def cell_row(records: pd.DataFrame, **key: Any) -> dict[str, Any]:
    """One row of load_ratio.csv: a cell's TPOT and the link it ran under."""
    mean = lambda c: float(records[c].mean()) if c in records and records[c].notna().any() else None
    return {**key, "records": len(records), "tpot_ms": float(records.tpot_ms.median()),
            "tpot_mean_ms": float(records.tpot_ms.mean()), **ratio_summary(records),
            "layer_step_ms": mean("layer_step_ms"), "expert_load_ms": mean("expert_load_ms"),
            "acceptance_alpha": mean("acceptance_alpha"),
            "h2d_mb_per_token": float((records.h2d_bytes / records.new_tokens).mean() / 1e6)
            if records.h2d_bytes.notna().any() else None}


def load_ratio_sweep(cfg: DictConfig) -> Path:
    from specter.experiments.run import run

    models, tiers, ratios, methods = sweep_settings(cfg)
    root = Path(cfg.output_dir)
    rows = []
    for model in models:
        for method in (m for m in methods if linkless(m)):
            print(f"\n== {model} {method} (no link: one run for every r) ==", flush=True)
            out = run(cell_config(cfg, model, tiers[0], method, None, root / model / method))
            rec = pd.read_csv(out / "records.csv")
            named = named_ratios(cfg, model)
            rows += [cell_row(rec, model=model, memory=t, hardware=cfg.hardware.name, method=method, load_ratio=r,
                              point=named.get(r, "")) for t in tiers for r in sorted({*ratios, *named})]
        named = named_ratios(cfg, model)
        for tier in tiers:
            for r in sorted({*ratios, *named}):
                for method in (m for m in methods if not linkless(m)):
                    print(f"\n== {model} memory={tier} {ratio_label(r)} {method} ==", flush=True)
                    out = run(cell_config(cfg, model, tier, method, r, root / model / tier / ratio_label(r) / method))
                    rows.append(cell_row(pd.read_csv(out / "records.csv"), model=model, memory=tier,
                                         hardware=cfg.hardware.name, method=method, load_ratio=r,
                                         point=named.get(r, "")))
                    _write(root, rows)
    table = _write(root, rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"-> {root / TABLE}")
    return root


KEY = ["model", "memory", "hardware", "method", "load_ratio"]


def _write(root: Path, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """load_ratio.csv: this sweep's rows, plus the rows of other cells an earlier sweep into the same
    folder wrote (other models, tiers or methods); a cell measured again replaces its old row."""
    from specter.paths import atomic_write_text

    table = pd.DataFrame(rows)
    path = root / TABLE
    if path.exists():
        old = pd.read_csv(path)
        if set(KEY) <= set(old.columns):
            mine = set(map(tuple, table[KEY].astype(str).to_numpy()))
            keep = [tuple(k) not in mine for k in old[KEY].astype(str).to_numpy()]
            table = pd.concat([old[keep], table], ignore_index=True)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, table.to_csv(index=False))
    return table
