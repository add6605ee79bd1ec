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

from specter.assembly.config import ConfigError

REAL_MODELS = ("dsv2", "qwen15moe", "phi35moe")
ROUTE_CHOICES = ("auto", "proxy", "independent")
# residency: an engine row's expert-cache policy (window: Specter's; lru: the baselines', as their designs give them);
# draft: the INT4 draft a speculative row ran; K and k_source: its draft length, "profiled" (on the modelled
# device) or "paper" (the method's default: the paper's K, SpecMoEOff's artifact K = 3); the last four columns
# are the engine's load-efficiency counters (empty for target_only): loads per window and tiny layer and retention hits
# from its records; loads over the Belady bound at the method's own slots and that bound in real loads per token, over
# the decode's verified routes (`engine_run.decode_bound`). specter_belady_loads_per_token, on every engine row of an
# offloading method: the lowest bound of this projection's Specter rows, beside the row's measured loads_per_token (in
# the copy-bound regime TPOT is about loads/token x one expert's H2D, so no schedule at Specter's slots and windows
# beats a rival whose measured loads/token are below it).
CSV_FIELDS = ("model", "memory", "device", "proxy", "routes", "method", "source", "draft", "K", "k_source", "tokens",
              "resident", "staging", "residency", "tpot_ms", "loads_per_token", "copy_busy", "acceptance", "paper_tpot_ms", "ratio",
              "loads_per_window_layer", "retention_hits", "loads_over_belady", "belady_loads_per_token",
              "specter_belady_loads_per_token", "note")


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

    from specter.assembly.compose import CONF_DIR, hardware_defaults
    from specter.assembly.schema import HardwareConfig, ModelConfig

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
    from specter.assembly.plan import plan_rows

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
    from specter.assembly.config import effective_K
    from specter.assembly.plan import plan_rows

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


def engine_rows(cfg: DictConfig, cm, px) -> tuple[list[dict], dict]:
    """Every method of `project.methods` built by the harness on the proxy and run on the virtual machine
    (`specter.projection.steps`); a profiled method twice: at its profiled K, then at its default K."""
    from specter.assembly.runners import is_method
    from specter.projection.profile import profile_rows
    from specter.projection.steps import draft_name, engine_runs

    runs, profiled = engine_runs(px, cm)
    draft = draft_name(str(cfg.project.quant), px.draft_bits)
    rows, primary = [], {}
    for name, source, r in runs:
        primary.setdefault(name, r)  # the first row of a method is its primary one (its timeline, its tokens)
        M, S = px.slots[name]
        rows.append(engine_row(cfg, name, source, r, M, S, draft if is_method(name, speculative=True) else ""))
    base = {"model": px.real, "memory": str(cfg.memory.name), "device": cm.d.name, "draft": draft}
    profiles = [row for prof in profiled.values() for row in profile_rows(prof, base)]
    return rows, {"runs": primary, "profile_rows": profiles}


def engine_row(cfg: DictConfig, name: str, k_source: str, r, M, S, draft: str) -> dict:
    from specter.assembly.runners import is_method, method_facts
    from specter.projection.engine_run import EXTRA_STATS

    p = cfg.project
    cache = is_method(name, owns_cache=True)  # target_only: every expert on the device, no slots
    return {"method": name, "source": "engine", "tokens": str(int(p.prompts) * int(p.new_tokens)),
            "resident": "" if M is None or not cache else str(M),
            "staging": str(S) if cache else "0", "residency": r.residency, "draft": draft,
            "K": "" if r.K is None else str(r.K), "k_source": k_source if r.K is not None else "",
            "tpot_ms": _fmt(r.tpot, 1e3), "loads_per_token": _fmt(r.loads_per_token),
            "copy_busy": _fmt(r.copy_busy), "acceptance": _fmt(r.acceptance),
            **{k: _fmt(r.extra.get(k)) for k in EXTRA_STATS}, "note": method_facts(name).summary}


def project_rows(cfg: DictConfig) -> tuple[list[dict[str, str]], dict]:
    from specter.projection.cost_model import cost_model
    from specter.projection.steps import Proxy, check_project, draft_name

    p = cfg.project
    if p.routes not in ROUTE_CHOICES:
        raise ConfigError(f"project.routes={p.routes!r} is not one of {list(ROUTE_CHOICES)}")
    if int(p.tokens) < 1:
        raise ConfigError(f"project.tokens must be >= 1, got {p.tokens}")
    check_project(cfg)
    real, proxy, trained = real_and_proxy(cfg)
    try:
        cm = cost_model(real, str(p.device))
    except FileNotFoundError as err:
        raise ConfigError(f"project.device: {err}") from None
    slots, K = method_slots(cfg, real)
    M, staging = slots["offload_ar"]
    engine_steps = list(p.methods) or bool(p.batch) or bool(p.alpha)
    px = Proxy(cfg, proxy, slots, K, real) if engine_steps else None
    engine, run = engine_rows(cfg, cm, px) if list(p.methods) else ([], {"runs": {}, "profile_rows": []})
    replay, source = replay_rows(cfg, cm, real, proxy, trained, M, staging)
    paper = paper_tpots(real, str(cfg.memory.name))
    base = {"model": real, "memory": str(cfg.memory.name), "device": cm.d.name,
            "proxy": px.name if px is not None else "", "routes": source}
    rows = []
    for r in [*engine, *replay]:
        row = {f: "" for f in CSV_FIELDS}
        row.update(base)
        row.update(r)
        if r["source"] == "engine" and r["method"] in paper and row["tpot_ms"]:
            row["paper_tpot_ms"] = f"{paper[r['method']]:.1f}"
            row["ratio"] = f"{float(row['tpot_ms']) / paper[r['method']]:.4f}"
        rows.append(row)
    bound = specter_bound(rows)
    for row in rows:
        if bound is not None and row["source"] == "engine" and row["loads_per_token"]:
            row["specter_belady_loads_per_token"] = _fmt(bound)
    facts = {"real": real, "proxy": base["proxy"], "trained": px.trained if px is not None else None,
             "source": source, "resident": M, "staging": staging, "shape": cm.s, "device": cm.d.name,
             "h2d_ms": cm.h2d() * 1e3, "tokens": int(p.tokens), "runs": run["runs"], "K": K, "cm": cm, "px": px,
             "draft": draft_name(str(p.quant), px.draft_bits if px is not None else 4), "profile_rows": run["profile_rows"]}
    return rows, facts


def specter_bound(rows: list[dict[str, str]]) -> float | None:
    """The lowest Belady bound (real loads per token over the decode, at Specter's slots) of Specter's engine rows."""
    vals = [float(r["belady_loads_per_token"]) for r in rows
            if r["source"] == "engine" and r["method"] == "specter" and r.get("belady_loads_per_token")]
    return min(vals) if vals else None


def copy_bound_lines(rows: list[dict[str, str]], h2d_ms: float) -> list[str]:
    """Specter's Belady loads/token beside each rival's measured loads/token, and what that allows.

    On the virtual clock every real load holds the copy stream one expert's H2D, and a decode's copies land between
    its first and last commit, so Specter's TPOT is at least its decode loads/token x H2D, and at least its bound x
    H2D (its floor): at its slots, its windows (K, acceptance) and the state its prefill left, no residency policy goes
    below that. A rival whose TPOT is under Specter's lowest floor cannot be beaten at those slots and windows; one
    whose measured loads/token are under Specter's bound can be beaten only by the time its copy stream sits idle."""
    spec = [r for r in rows if r["source"] == "engine" and r["method"] == "specter" and r.get("belady_loads_per_token")]
    rivals = [r for r in rows if r["source"] == "engine" and r["method"] != "specter" and r["loads_per_token"]]
    if not spec or not rivals:
        return []
    best = min(spec, key=lambda r: float(r["tpot_ms"]))
    floor = min(float(r["belady_loads_per_token"]) for r in spec) * h2d_ms
    out = [f"  copy-bound check: TPOT >= loads/token x one expert's H2D ({h2d_ms:.3f} ms). Specter's Belady-optimal "
           "loads/token at its slots over its verified routes: "
           + ", ".join(f"{float(r['belady_loads_per_token']):.2f} at K={r['K']} {r['k_source']} "
                       f"(floor {float(r['belady_loads_per_token']) * h2d_ms:.2f} ms; measured {float(r['loads_per_token']):.2f}, "
                       f"{float(r['tpot_ms']):.2f} ms)" for r in spec)]
    body = []
    for r in rivals:
        tpot = float(r["tpot_ms"])
        if float(best["tpot_ms"]) < tpot:
            verdict = "Specter faster"
        elif floor < tpot and min(float(x["belady_loads_per_token"]) for x in spec) <= float(r["loads_per_token"]):
            verdict = "Specter slower; its bound leaves room to win"
        elif floor < tpot:
            verdict = ("Specter slower; its bound is above the rival's loads/token, so only the rival's "
                       "time off the copy stream leaves room")
        else:
            verdict = "cannot be won at Specter's slots and windows: its floor >= the rival's TPOT"
        body.append((r["method"], f"{r['K']} {r['k_source']}" if r["K"] else "-", f"{r['resident']}+{r['staging']}",
                     r["loads_per_token"], r["tpot_ms"], r["specter_belady_loads_per_token"] or "-", f"{floor:.4f}",
                     best["tpot_ms"], verdict))
    out += text_table(("rival", "K", "M+S", "loads/token", "TPOT ms", "Specter bound", "Specter floor ms",
                       "Specter TPOT ms", "verdict"), body, left=(0, 1))
    return out


def project_csv(rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def text_table(head: tuple[str, ...], body: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Aligned plain-text rows: columns in `left` (and the last) left-aligned, the rest right-aligned."""
    table = [head, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  " + "  ".join(c.ljust(w) if j in left or j == len(head) - 1 else c.rjust(w)
                                      for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def format_projection(rows: list[dict[str, str]], facts: dict) -> str:
    from specter.projection.engine_run import EXTRA_STATS

    s = facts["shape"]
    routes = (f"the proxy {facts['source']}'s teacher-forced routes" if facts["source"] != "independent"
              else "INDEPENDENT uniform top-k routes (no proxy checkpoint found)")
    proxy = facts["proxy"] and (f"{facts['proxy']} ({'trained' if facts['trained'] else 'UNTRAINED: random weights, no trained proxy found'})")
    lines = [f"projected TPOT: {facts['real']} memory={rows[0]['memory']} on {facts['device']}, draft {facts['draft']} "
             f"({s.moe_layers} MoE layers, top-{s.top_k} of {s.num_experts}; one expert's H2D {facts['h2d_ms']:.3f} ms)",
             "  a model of that machine (cost model + virtual clock) driven by the engine's own schedule, not a measurement",
             f"  engine rows: every method built by the harness on the proxy {proxy}, run on the virtual clock; "
             f"K: profiled on {facts['device']} or the paper's",
             f"  replay rows: offload_ar replayed over {facts['tokens']} tokens of {routes} (cross-check)"]
    extra = [k for k in EXTRA_STATS if any(r.get(k) for r in rows)]  # the engine's counters, once it reports them
    head = ("method", "source", "draft", "K", "M+S", "residency", "TPOT ms", "paper ms", "ratio", "loads/token", "copy busy",
            "accept", *extra, "note")
    body = [(r["method"], r["source"], r["draft"] or "-", f"{r['K']} {r['k_source']}" if r["K"] else "-",
             f"{r['resident']}+{r['staging']}" if r["resident"] else "-", r.get("residency") or "-", r["tpot_ms"] or "-", r["paper_tpot_ms"] or "-",
             r["ratio"] or "-", r["loads_per_token"] or "-", r["copy_busy"] or "-", r["acceptance"] or "-",
             *(r.get(k) or "-" for k in extra), r["note"]) for r in rows]
    lines += text_table(head, body, left=(0, 1, 2, 3, 5))
    lines += copy_bound_lines(rows, facts["h2d_ms"])
    return "\n".join(lines) + "\n"


def rows_csv(fields: tuple[str, ...], rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", restval="")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def format_profiles(rows: list[dict[str, str]]) -> str:
    """Each profile's K set, the chosen K marked."""
    if not rows:
        return ""
    r0 = rows[0]
    lines = [f"K profile on {r0['device']} ({r0['model']} memory={r0['memory']}, draft {r0['draft']}): "
             "projected TPOT on the profile prompts per K, * = the fastest"]
    lines += text_table(("method", "K", "TPOT ms", "loads/token", "accept", ""),
                        [(r["method"], r["K"], r["tpot_ms"], r["loads_per_token"], r["acceptance"] or "-",
                          "*" if r["chosen"] == "true" else "") for r in rows])
    return "\n".join(lines) + "\n"


TIMELINE_FIELDS = ("model", "memory", "device", "draft", "method", "K", "stream", "op", "start_ms", "end_ms")


def timeline_csv(rows: list[dict[str, str]], facts: dict) -> str:
    """One speculative window of Specter on the virtual clock: every op of both streams (exact bytes)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(TIMELINE_FIELDS)
    run = facts["runs"].get("specter")
    for stream, op, a, b in (run.timeline if run is not None else []):
        w.writerow([facts["real"], rows[0]["memory"], facts["device"], facts["draft"], "specter", run.K, stream, op,
                    f"{a * 1e3:.6f}", f"{b * 1e3:.6f}"])
    return buf.getvalue()


def paper_claims(real: str) -> list[dict[str, str]]:
    """The paper's batching claims for this model (results/paper/claims.csv, typed from its text)."""
    path = Path(__file__).resolve().parents[2] / "results" / "paper" / "claims.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return [r for r in csv.DictReader(f) if r["model"] == real and r["claim"].startswith("batch_")]


BATCH_VS_PAPER_FIELDS = ("model", "memory", "device", "draft", "claim", "method", "baseline", "batch_from", "batch_to",
                         "paper", "projected", "projected_max", "projected_max_at")


def batch_vs_paper(rows: list[dict[str, str]], claims: list[dict[str, str]], base: dict[str, str]) -> list[dict]:
    """Each batching claim of the paper beside the same ratio from the projected batch table: at the claim's B,
    and, for a claim against SpecMoEOff (quoted as a maximum), the largest projected value over B."""
    at = {(r["method"], int(r["batch_size"])): r for r in rows}
    metric = {"batch_tpot_ratio": "tpot_ms", "batch_throughput_ratio": "throughput_tok_s",
              "batch_working_set_ratio": "working_set", "batch_tpot_speedup": "tpot_ms",
              "batch_throughput_gain": "throughput_tok_s"}

    def value(claim: str, b0: int, b1: int) -> float | None:
        col = metric[claim]
        if claim in ("batch_tpot_speedup", "batch_throughput_gain"):  # Specter against SpecMoEOff at one B
            s, o = at.get(("specter", b1)), at.get(("specmoeoff", b1))
            if s is None or o is None or not s[col] or not o[col]:
                return None
            return float(o[col]) / float(s[col]) if col == "tpot_ms" else float(s[col]) / float(o[col])
        a, b = at.get(("specter", b0)), at.get(("specter", b1))
        return float(b[col]) / float(a[col]) if a and b and a[col] and b[col] else None

    out = []
    sizes = sorted({B for _, B in at})
    for c in claims:
        if c["claim"] not in metric:
            continue
        b0, b1 = int(c["batch_from"]), int(c["batch_to"])
        v = value(c["claim"], b0, b1)
        best = None
        if c["claim"] in ("batch_tpot_speedup", "batch_throughput_gain"):
            vals = [(x, B) for B in sizes if (x := value(c["claim"], B, B)) is not None]
            best = max(vals) if vals else None
        out.append({**base, "claim": c["claim"], "method": c["method"], "baseline": c["baseline"],
                    "batch_from": str(b0), "batch_to": str(b1), "paper": c["value"],
                    "projected": "" if v is None else f"{v:.4f}",
                    "projected_max": "" if best is None else f"{best[0]:.4f}",
                    "projected_max_at": "" if best is None else str(best[1])})
    return out


def format_batch(rows: list[dict[str, str]], versus: list[dict[str, str]]) -> str:
    r0 = rows[0]
    lines = [f"projected batching on {r0['device']}: {r0['model']} memory={r0['memory']}, draft {r0['draft']} "
             "(per-request KV; TPOT = mean per-request TPOT, throughput = tokens / batch span)"]
    lines += text_table(("method", "K", "B", "TPOT ms", "tokens/s", "loads/token", "accept", "working set",
                         "TPOT/B=1", "tput/B=1"),
                        [(r["method"], r["K"], r["batch_size"], r["tpot_ms"], f"{float(r['throughput_tok_s']):.1f}",
                          r["loads_per_token"], r["acceptance"] or "-", r["working_set"] or "-", r["tpot_vs_b1"],
                          r["throughput_vs_b1"]) for r in rows])
    if versus:
        lines.append("  beside the paper (results/paper/claims.csv):")
        lines += text_table(("claim", "B", "paper", "projected", "projected max (B)"),
                            [(f"{v['claim']}{' vs ' + v['baseline'] if v['baseline'] else ''}",
                              f"{v['batch_from']}->{v['batch_to']}", v["paper"], v["projected"] or "-",
                              f"{v['projected_max']} ({v['projected_max_at']})" if v["projected_max"] else "-")
                             for v in versus])
    return "\n".join(lines) + "\n"


def format_alpha(rows: list[dict[str, str]]) -> str:
    r0 = rows[0]
    lines = [f"alpha curve on {r0['device']}: {r0['model']} memory={r0['memory']}; every draft charged the paper's "
             "INT4 g128 cost, so only the acceptance moves (paper: mean alpha 0.966)"]
    lines += text_table(("method", "K", "draft", "alpha", "TPOT ms", "loads/token"),
                        [(r["method"], r["K"], r["draft"], r["alpha"] or "-", r["tpot_ms"] or "-",
                          r["loads_per_token"] or "-") for r in rows], left=(0, 1, 2))
    return "\n".join(lines) + "\n"


def run_project(cfg: DictConfig) -> Path:
    """`experiment=project`: print the projection, write `<output_dir>/projection.csv`, `timeline.csv` and
    `k_profile.csv`; with project.batch, `batch_projection.csv` and `batch_vs_paper.csv`; with project.alpha,
    `alpha_curve.csv` (exact bytes)."""
    from specter.paths import atomic_write_text
    from specter.projection.alpha import ALPHA_FIELDS
    from specter.projection.batching import BATCH_FIELDS
    from specter.projection.profile import PROFILE_FIELDS
    from specter.projection.steps import alpha_step, batch_step

    rows, facts = project_rows(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(format_profiles(facts["profile_rows"]), end="", flush=True)
    print(format_projection(rows, facts), end="", flush=True)
    atomic_write_text(out / "projection.csv", project_csv(rows))
    atomic_write_text(out / "timeline.csv", timeline_csv(rows, facts))
    if facts["profile_rows"]:
        atomic_write_text(out / "k_profile.csv", rows_csv(PROFILE_FIELDS, facts["profile_rows"]))
    print(f"  table: {out / 'projection.csv'}")
    px, cm = facts["px"], facts["cm"]
    base = {"model": facts["real"], "memory": str(cfg.memory.name), "device": cm.d.name, "draft": facts["draft"]}
    if cfg.project.batch:
        batch = batch_step(px, cm, base)
        versus = batch_vs_paper(batch, paper_claims(facts["real"]), base)
        print(format_batch(batch, versus), end="", flush=True)
        atomic_write_text(out / "batch_projection.csv", rows_csv(BATCH_FIELDS, batch))
        atomic_write_text(out / "batch_vs_paper.csv", rows_csv(BATCH_VS_PAPER_FIELDS, versus))
        print(f"  batching: {out / 'batch_projection.csv'}, {out / 'batch_vs_paper.csv'}")
    if cfg.project.alpha:
        alpha = alpha_step(px, cm, {k: v for k, v in base.items() if k != "draft"})
        print(format_alpha(alpha), end="", flush=True)
        atomic_write_text(out / "alpha_curve.csv", rows_csv(ALPHA_FIELDS, alpha))
        print(f"  alpha curve: {out / 'alpha_curve.csv'}")
    return out
