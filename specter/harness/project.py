"""`experiment=project`: projected TPOT of each method at a real model's sizes on a modelled GPU.

    python run.py experiment=project model=dsv2 memory=high
    python run.py experiment=project model=phi35moe memory=low project.device=h200_pcie5

No weights, no GPU: the cost model (`specter/projection/cost_model.py`, a device file in
`specter/projection/devices/`) charges every operation at the real model's shapes, and
`specter/projection/simulate.py` replays per-token routes on the two-stream virtual clock with the
engine's LRU policy. The routes are the tiny proxy's own (its routers hooked while a held-out text is
teacher-forced, mapped onto the real layers by `specter/projection/mapping.py`) when the proxy's
checkpoint is in $SPECTER_HOME, else seeded independent uniform top-k routes; the table's title and
the CSV's `routes` column say which. It is a model of the paper's machine, not a measurement.
Methods not replayed yet are listed as "not projected yet" (no number is made up for them).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from specter.harness.config import ConfigError

REAL_MODELS = ("dsv2", "qwen15moe", "phi35moe")
PROJECTED = ("target_only", "offload_ar")
NOT_PROJECTED = ("mo_sc", "mo_sm", "specmoeoff", "moe_spec", "specter")
ROUTE_CHOICES = ("auto", "proxy", "independent")
CSV_FIELDS = ("model", "memory", "device", "routes", "tokens", "resident", "staging", "method", "tpot_ms", "misses_per_token",
              "copy_busy", "note")


def real_and_proxy(cfg: DictConfig) -> tuple[str, str, bool]:
    """(real model conf name, tiny proxy name, whether the proxy is the trained one)."""
    from specter.models.tiny import TINY_SPECS

    m = cfg.model
    if m.source == "tiny":
        real = m.get("real")
        if real not in REAL_MODELS:
            raise ConfigError(f"experiment=project: {m.name} mirrors {real!r}, not one of {list(REAL_MODELS)}")
        return real, m.name, bool(m.get("trained"))
    if m.name not in REAL_MODELS:
        raise ConfigError(f"experiment=project: model={m.name} is not one of {list(REAL_MODELS)} (or a tiny proxy)")
    hf = {"dsv2": "DeepSeek-V2-Lite", "qwen15moe": "Qwen1.5-MoE-A2.7B", "phi35moe": "Phi-3.5-MoE-instruct"}[m.name]
    proxy = next(s.name for s in TINY_SPECS.values() if s.real.endswith("/" + hf))
    return m.name, proxy, True


def paper_case(cfg: DictConfig, real: str) -> DictConfig:
    """The run's config as the paper's case of the real model: conf/model/<real>.yaml (its tiers),
    hardware=cuda (FP16), one request."""
    import copy

    from omegaconf import open_dict

    from specter.harness.compose import CONF_DIR, hardware_defaults
    from specter.harness.schema import HardwareConfig, ModelConfig

    case = copy.deepcopy(cfg)
    with open_dict(case):
        if cfg.model.name != real:
            data = OmegaConf.load(CONF_DIR / "model" / f"{real}.yaml")
            data.pop("defaults", None)
            case.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), data)
        case.hardware = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hardware_defaults("cuda"))
        case.batch.sizes = [1]
    return case


def real_slots(cfg: DictConfig, real: str) -> tuple[int, int]:
    """(slots per MoE layer, staging buffers) of offload_ar in the paper's case: `memory.resident_experts`
    if given, else the real model's tier (conf/model/<real>.yaml `tiers.<tier>.resident_experts`); the
    staging buffers by the engine's one rule on that tier's budget (as experiment=plan computes them)."""
    from specter.harness.plan import plan_rows

    case = paper_case(cfg, real)
    rows, _ = plan_rows(case)
    row = next(r for r in rows if r.method == "offload_ar" and r.batch == 1)
    return int(row.resident), int(row.staging)


def independent_routes(moe_layers: int, num_experts: int, top_k: int, tokens: int, seed: int) -> list[dict[int, list[int]]]:
    """Seeded independent uniform top-k routes: every (token, layer) draws k distinct experts."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [{layer: [int(e) for e in rng.choice(num_experts, top_k, replace=False)] for layer in range(moe_layers)}
            for _ in range(tokens)]


def proxy_routes(folder: Path, tokens: int, moe_layers: int, num_experts: int, seed: int) -> list[dict[int, list[int]]]:
    """The proxy's own routes on `tokens` held-out tokens (teacher-forced), mapped onto the real MoE layers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specter.models.facts import facts_from_config
    from specter.projection.mapping import RouteMap
    from specter.routing_stats import HELD_OUT, held_out_docs, record_routes

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tiny_experts = facts_from_config(model.config).num_experts
    docs, _ = held_out_docs(tokenizer, HELD_OUT, tokens)
    recorded = record_routes(model, docs)  # tiny MoE layer -> per document [N_d, k]
    layers = sorted(recorded)
    per_layer = [torch.cat(recorded[layer]) for layer in layers]  # [tokens, k] each
    rmap = RouteMap(len(layers), tiny_experts, moe_layers, num_experts, seed=seed)
    out = []
    for t in range(per_layer[0].shape[0]):
        step: dict[int, list[int]] = {}
        for j, ids in enumerate(per_layer):
            step.update(rmap.map(j, [int(e) for e in ids[t]]))
        out.append(step)
    return out


def project_rows(cfg: DictConfig) -> tuple[list[dict[str, str]], dict]:
    from specter.models.tiny import tiny_dir
    from specter.projection.cost_model import cost_model
    from specter.projection.simulate import offload_ar, target_only

    p = cfg.project
    if p.routes not in ROUTE_CHOICES:
        raise ConfigError(f"project.routes={p.routes!r} is not one of {list(ROUTE_CHOICES)}")
    if int(p.tokens) < 1:
        raise ConfigError(f"project.tokens must be >= 1, got {p.tokens}")
    real, proxy, trained = real_and_proxy(cfg)
    try:
        cm = cost_model(real, str(p.device))
    except FileNotFoundError as err:
        raise ConfigError(f"project.device: {err}") from None
    s = cm.s
    M, staging = real_slots(cfg, real)
    tokens, seed = int(p.tokens), int(cfg.seed)
    folder = tiny_dir(proxy, trained=trained)
    have_proxy = (folder / "config.json").is_file()
    if p.routes == "proxy" and not have_proxy:
        raise ConfigError(f"project.routes=proxy: no proxy checkpoint {folder} (train it with: python run.py "
                          f"model={proxy} model.trained=true), or use project.routes=independent")
    if p.routes != "independent" and have_proxy:
        routes = proxy_routes(folder, tokens, s.moe_layers, s.num_experts, seed)
        source = folder.name
    else:
        routes = independent_routes(s.moe_layers, s.num_experts, s.top_k, tokens, seed)
        source = "independent"
    base = {"model": real, "memory": cfg.memory.name, "device": cm.d.name, "routes": source,
            "tokens": str(len(routes)), "resident": str(M), "staging": str(staging)}
    rows = [{**base, "method": "target_only", "tpot_ms": f"{target_only(cm, len(routes)) * 1e3:.4f}",
             "misses_per_token": "", "copy_busy": "", "note": "every expert resident"}]
    if M + staging < s.top_k:
        rows.append({**base, "method": "offload_ar", "tpot_ms": "", "misses_per_token": "", "copy_busy": "",
                     "note": f"not projected: M={M} + {staging} staging buffers < top-k={s.top_k}"})
    else:
        r = offload_ar(cm, routes, min(M, s.num_experts), staging)
        note = "LRU on demand" + (f"; {r['staged_per_token']:.2f} staged loads/token" if r["staged_per_token"] else "")
        rows.append({**base, "method": "offload_ar", "tpot_ms": f"{r['tpot'] * 1e3:.4f}",
                     "misses_per_token": f"{r['misses_per_token']:.4f}", "copy_busy": f"{r['copy_busy']:.4f}",
                     "note": note})
    for name in NOT_PROJECTED:
        rows.append({**base, "method": name, "tpot_ms": "", "misses_per_token": "", "copy_busy": "",
                     "note": "not projected yet"})
    facts = {"real": real, "proxy": proxy, "source": source, "resident": M, "staging": staging, "shape": s, "device": cm.d.name,
             "h2d_ms": cm.h2d() * 1e3, "tokens": len(routes)}
    return rows, facts


def project_csv(rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def format_projection(rows: list[dict[str, str]], facts: dict) -> str:
    s = facts["shape"]
    routes = (f"routes of the proxy {facts['source']} (held-out text, teacher-forced, mapped onto the real layers)"
              if facts["source"] != "independent" else "INDEPENDENT uniform top-k routes (no proxy checkpoint found)")
    lines = [f"projected TPOT: {facts['real']} memory={rows[0]['memory']} (M={facts['resident']} of {s.num_experts} "
             f"experts + {facts['staging']} staging buffers, top-{s.top_k}, {s.moe_layers} MoE layers) on {facts['device']}, {facts['tokens']} tokens of "
             f"{routes}",
             "  a model of that machine (cost model + virtual clock), not a measurement; one expert's H2D "
             f"{facts['h2d_ms']:.3f} ms"]
    head = ("method", "TPOT ms", "misses/token", "copy busy", "note")
    table = [head] + [(r["method"], r["tpot_ms"] or "-", r["misses_per_token"] or "-", r["copy_busy"] or "-",
                       r["note"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        lines.append("  " + "  ".join(c.ljust(w) if j in (0, 4) else c.rjust(w)
                                      for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def run_project(cfg: DictConfig) -> Path:
    """`experiment=project`: print the projection and write `<output_dir>/projection.csv` (exact bytes)."""
    from specter.paths import atomic_write_text

    rows, facts = project_rows(cfg)
    print(format_projection(rows, facts), end="", flush=True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "projection.csv", project_csv(rows))
    print(f"  table: {out / 'projection.csv'}")
    return out
