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
PROJECTED = ("target_only", "offload_ar", "mo_sc", "mo_sm", "specmoeoff", "moe_spec", "specter")
ROUTE_CHOICES = ("auto", "proxy", "independent")
CSV_FIELDS = ("model", "memory", "device", "proxy", "routes", "method", "source", "tokens", "resident", "staging", "tpot_ms",
              "loads_per_token", "copy_busy", "acceptance", "paper_tpot_ms", "ratio", "note")


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


def proxy_routes(folder: Path, tokens: int, moe_layers: int, num_experts: int, seed: int,
                 permute: bool = True) -> list[dict[int, list[int]]]:
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
    rmap = RouteMap(len(layers), tiny_experts, moe_layers, num_experts, seed=seed, permute=permute)
    out = []
    for t in range(per_layer[0].shape[0]):
        step: dict[int, list[int]] = {}
        for j, ids in enumerate(per_layer):
            step.update(rmap.map(j, [int(e) for e in ids[t]]))
        out.append(step)
    return out


def method_slots(cfg: DictConfig, real: str) -> tuple[dict[str, tuple[int | None, int]], int]:
    """Per method, (slots per MoE layer, staging buffers) in the paper's case of the real model (the plan's
    batch-1 rows, what `experiment=plan` prints), and the K a speculative method verifies there."""
    from specter.harness.config import effective_K
    from specter.harness.plan import plan_rows

    case = paper_case(cfg, real)
    rows, _ = plan_rows(case)
    return {r.method: (r.resident, int(r.staging)) for r in rows if r.batch == 1}, effective_K(case)


def _fmt(x: float | None, scale: float = 1.0) -> str:
    return "" if x is None else f"{x * scale:.4f}"


def paper_tpots(real: str, memory: str) -> dict[str, float]:
    """The paper's single-request TPOTs (ms) of this model and tier (results/paper/tpot_single_request.csv)."""
    path = Path(__file__).resolve().parents[2] / "results" / "paper" / "tpot_single_request.csv"
    if not path.is_file():
        return {}
    with path.open() as f:
        return {r["method"]: float(r["tpot_ms"]) for r in csv.DictReader(f)
                if r["model"] == real and r["memory"] == memory and r["dataset"] == "AVG"}


def replay_rows(cfg: DictConfig, cm, real: str, proxy: str, trained: bool, M: int, staging: int) -> tuple[list[dict], str]:
    """offload_ar replayed (`simulate.offload_ar`) over the proxy's teacher-forced routes mapped onto the real
    layers (permuted RouteMap, and unpermuted for the mapping's sensitivity), or independent routes."""
    from specter.models.tiny import tiny_dir
    from specter.projection.simulate import offload_ar

    p, s = cfg.project, cm.s
    tokens, seed = int(p.tokens), int(cfg.seed)
    folder = tiny_dir(proxy, trained=trained)
    if trained and not (folder / "config.json").is_file() and list(p.methods):
        folder = tiny_dir(proxy, trained=False)  # the proxy the engine rows ran (untrained when no trained one)
    have_proxy = (folder / "config.json").is_file()
    if p.routes == "proxy" and not have_proxy:
        raise ConfigError(f"project.routes=proxy: no proxy checkpoint {folder} (train it with: python run.py "
                          f"model={proxy} model.trained=true), or use project.routes=independent")
    variants = []
    if p.routes != "independent" and have_proxy:
        source = folder.name
        variants = [("replay", proxy_routes(folder, tokens, s.moe_layers, s.num_experts, seed)),
                    ("replay_unpermuted", proxy_routes(folder, tokens, s.moe_layers, s.num_experts, seed, permute=False))]
    else:
        source = "independent"
        variants = [("replay", independent_routes(s.moe_layers, s.num_experts, s.top_k, tokens, seed))]
    rows = []
    for name, routes in variants:
        if M + staging < s.top_k:
            rows.append({"method": "offload_ar", "source": name, "tokens": str(len(routes)),
                         "note": f"not projected: M={M} + {staging} staging buffers < top-k={s.top_k}"})
            continue
        r = offload_ar(cm, routes, min(M, s.num_experts), staging)
        note = f"routes {source}" + (f"; {r['staged_per_token']:.2f} staged loads/token" if r["staged_per_token"] else "")
        rows.append({"method": "offload_ar", "source": name, "tokens": str(len(routes)), "resident": str(M),
                     "staging": str(staging), "tpot_ms": _fmt(r["tpot"], 1e3),
                     "loads_per_token": _fmt(r["misses_per_token"]), "copy_busy": _fmt(r["copy_busy"]), "note": note})
    return rows, source


def engine_rows(cfg: DictConfig, cm, real: str, proxy: str, slots: dict, K: int) -> tuple[list[dict], dict]:
    """Every method of `project.methods` built by the harness on the proxy and run on the virtual machine."""
    from specter.harness.compose import compose
    from specter.harness.runtime import model_checkpoint
    from specter.models.tiny import tiny_dir
    from specter.projection.engine_run import held_out_prompts, proxy_overrides, run_method

    p = cfg.project
    trained = (tiny_dir(proxy, trained=True) / "config.json").is_file()
    methods = list(p.methods)
    unknown = [m for m in methods if m not in PROJECTED]
    if unknown:
        raise ConfigError(f"project.methods: {unknown} are not in-process methods; choose from {list(PROJECTED)}")
    if str(p.quant) not in ("rtn", "gptq"):
        raise ConfigError(f"project.quant={p.quant!r} is not rtn or gptq")
    if int(p.prompts) < 1 or int(p.new_tokens) < 2:
        raise ConfigError("project.prompts must be >= 1 and project.new_tokens >= 2")
    tier, seed = str(cfg.memory.name), int(cfg.seed)
    rows, runs = [], {}
    prompts = None
    for name in methods:
        over = proxy_overrides(proxy, trained, tier, name, slots[name], K, str(p.quant), seed)
        mcfg = compose([*over, f"prefix_tokens={int(cfg.prefix_tokens)}"])
        checkpoint = model_checkpoint(mcfg)
        if prompts is None:
            prompts = held_out_prompts(checkpoint, int(p.prompts), int(cfg.prefix_tokens))
        r = run_method(mcfg, checkpoint, cm, prompts, int(p.new_tokens), int(p.warmup_tokens), slots[name],
                       int(p.timeline_window))
        runs[name] = r
        print(f"  {name}: {_fmt(r.tpot, 1e3) or '-'} ms/token projected", flush=True)
        M, S = slots[name]
        if name != "target_only" and (r.resident, r.staging) != (M, S):
            raise RuntimeError(f"{name}: the proxy ran with M={r.resident} + {r.staging} staging buffers, the real "
                               f"model's plan says M={M} + {S}")
        rows.append({"method": name, "source": "engine", "tokens": str(int(p.prompts) * int(p.new_tokens)),
                     "resident": "" if M is None or name == "target_only" else str(M),
                     "staging": str(S) if name != "target_only" else "0",
                     "tpot_ms": _fmt(r.tpot, 1e3), "loads_per_token": _fmt(r.loads_per_token),
                     "copy_busy": _fmt(r.copy_busy), "acceptance": _fmt(r.acceptance),
                     "note": NOTES[name] + (f"; K={K}" if name in ("specter", "moe_spec") else "")})
    proxy_name = tiny_dir(proxy, trained=trained).name
    return rows, {"runs": runs, "proxy": proxy_name, "trained": trained, "prompts": prompts}


NOTES = {"target_only": "every expert resident", "offload_ar": "LRU on demand", "mo_sc": "LRU + staging, same cache",
         "mo_sm": "LRU, same memory", "specmoeoff": "separate draft, K=3, route-frequency prefetch",
         "moe_spec": "Specter + verification expert budget", "specter": "shared INT4 draft, adaptive prefetch"}


def project_rows(cfg: DictConfig) -> tuple[list[dict[str, str]], dict]:
    from specter.projection.cost_model import cost_model

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
    slots, K = method_slots(cfg, real)
    M, staging = slots["offload_ar"]
    engine, run = engine_rows(cfg, cm, real, proxy, slots, K) if list(p.methods) else ([], {"runs": {}})
    replay, source = replay_rows(cfg, cm, real, proxy, trained, M, staging)
    paper = paper_tpots(real, str(cfg.memory.name))
    base = {"model": real, "memory": str(cfg.memory.name), "device": cm.d.name,
            "proxy": run.get("proxy", ""), "routes": source}
    rows = []
    for r in [*engine, *replay]:
        row = {f: "" for f in CSV_FIELDS}
        row.update(base)
        row.update(r)
        if r["source"] == "engine" and r["method"] in paper and row["tpot_ms"]:
            row["paper_tpot_ms"] = f"{paper[r['method']]:.1f}"
            row["ratio"] = f"{float(row['tpot_ms']) / paper[r['method']]:.4f}"
        rows.append(row)
    facts = {"real": real, "proxy": run.get("proxy", ""), "trained": run.get("trained"), "source": source,
             "resident": M, "staging": staging, "shape": cm.s, "device": cm.d.name, "h2d_ms": cm.h2d() * 1e3,
             "tokens": int(p.tokens), "runs": run.get("runs", {}), "K": K}
    return rows, facts


def project_csv(rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def format_projection(rows: list[dict[str, str]], facts: dict) -> str:
    s = facts["shape"]
    routes = (f"the proxy {facts['source']}'s teacher-forced routes" if facts["source"] != "independent"
              else "INDEPENDENT uniform top-k routes (no proxy checkpoint found)")
    proxy = facts["proxy"] and (f"{facts['proxy']} ({'trained' if facts['trained'] else 'UNTRAINED: random weights, no trained proxy found'})")
    lines = [f"projected TPOT: {facts['real']} memory={rows[0]['memory']} on {facts['device']} "
             f"({s.moe_layers} MoE layers, top-{s.top_k} of {s.num_experts}; one expert's H2D {facts['h2d_ms']:.3f} ms)",
             "  a model of that machine (cost model + virtual clock) driven by the engine's own schedule, not a measurement",
             f"  engine rows: every method built by the harness on the proxy {proxy}, run on the virtual clock",
             f"  replay rows: offload_ar replayed over {facts['tokens']} tokens of {routes} (cross-check)"]
    head = ("method", "source", "M+S", "TPOT ms", "paper ms", "ratio", "loads/token", "copy busy", "accept", "note")
    table = [head] + [(r["method"], r["source"], f"{r['resident']}+{r['staging']}" if r["resident"] else "-",
                       r["tpot_ms"] or "-", r["paper_tpot_ms"] or "-", r["ratio"] or "-", r["loads_per_token"] or "-",
                       r["copy_busy"] or "-", r["acceptance"] or "-", r["note"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        lines.append("  " + "  ".join(c.ljust(w) if j in (0, 1, len(head) - 1) else c.rjust(w)
                                      for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


TIMELINE_FIELDS = ("model", "memory", "device", "method", "stream", "op", "start_ms", "end_ms")


def timeline_csv(rows: list[dict[str, str]], facts: dict) -> str:
    """One speculative window of Specter on the virtual clock: every op of both streams (exact bytes)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(TIMELINE_FIELDS)
    run = facts["runs"].get("specter")
    for stream, op, a, b in (run.timeline if run is not None else []):
        w.writerow([facts["real"], rows[0]["memory"], facts["device"], "specter", stream, op, f"{a * 1e3:.6f}",
                    f"{b * 1e3:.6f}"])
    return buf.getvalue()


def run_project(cfg: DictConfig) -> Path:
    """`experiment=project`: print the projection, write `<output_dir>/projection.csv` and `timeline.csv` (exact bytes)."""
    from specter.paths import atomic_write_text

    rows, facts = project_rows(cfg)
    print(format_projection(rows, facts), end="", flush=True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "projection.csv", project_csv(rows))
    atomic_write_text(out / "timeline.csv", timeline_csv(rows, facts))
    print(f"  table: {out / 'projection.csv'}")
    return out
