"""Every in-process method, built by the harness's method builder on the tiny proxy, run on a `VirtualMachine`.

Per method: the proxy's config with the real model's slot counts for that method (what
`experiment=plan` derives for the paper's case: `plan_rows`), the device budget lifted (the proxy's
own budget would refuse the real tier's slots), greedy decoding, then one warm-up record and the
measured records, each from the reset cache. TPOT is the paper's definition on the virtual clock:
(last commit - first commit) / (tokens - 1), a commit being the end of a target forward (the prefill's,
then every step's or verification's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import torch
from omegaconf import DictConfig

from specter.assembly.runners import is_method, method_facts
from specter.projection.cost_model import CostModel
from specter.projection.virtual import VirtualMachine, attach


@dataclass
class Projected:
    """One method's projection: TPOT and what explains it."""

    method: str
    tpot: float | None  # seconds per token on the virtual clock
    loads_per_token: float | None  # real expert copies per decoded token
    copy_busy: float | None  # copy stream busy fraction over the decode
    acceptance: float | None  # accepted / drafted tokens (speculative methods)
    resident: int | None
    staging: int
    tokens: list[list[int]] = field(default_factory=list)  # per measured record
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)  # one window: (stream, op, start, end)
    route_windows: list[dict[int, set[int]]] = field(default_factory=list)  # the last record's target routes per window
    decode_forwards: int = 0  # target forwards of the last record (its prefill included)
    note: str = ""
    machine: VirtualMachine | None = None
    K: int | None = None  # the draft length a speculative method ran
    extra: dict[str, float] = field(default_factory=dict)  # EXTRA_STATS the records carried
    residency: str = ""  # the expert cache's residency policy (`specter.offload.policy`); empty for target_only


def proxy_overrides(proxy: str, trained: bool, tier: str, method: str, slots: tuple[int | None, int],
                    K: int | None, quant: str, seed: int) -> list[str]:
    """The proxy's config for `method` at the real model's slot counts (resident, staging)."""
    M, S = slots
    facts = method_facts(method)
    out = [f"model={proxy}", f"model.trained={str(trained).lower()}", f"method={method}", "hardware=cpu",
           f"memory={tier}", "temperature=0", "verify_lossless=false", f"seed={seed}"]
    if not facts.owns_cache:  # target_only: every expert on the device, no budget
        return out
    out += ["memory.budget_mb=1000000", f"method.staging_buffers={S}"]  # the real tier's slots, not the proxy's budget
    if facts.slots_rule == "same_memory":  # MO-SM sizes its own slots: the plan's count, given
        out.append(f"method.residents={M}")
    else:
        out.append(f"memory.resident_experts={M}")
    if facts.speculative:
        out.append(f"method.quant={quant}")
    if facts.reads_specter_profile and K is not None:  # SpecMoEOff's K comes from its own method.K
        out.append(f"K={K}")
    return out


def held_out_prompts(checkpoint: Path, count: int, length: int) -> list[torch.Tensor]:
    """`count` prompts of `length` tokens: the starts of held-out documents (humaneval, gsm8k)."""
    from transformers import AutoTokenizer

    from specter.routing_stats import HELD_OUT, held_out_docs

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # documents arrive in a fixed order whatever the budget, so a larger count only appends prompts; the budget
    # stays under what the bundled held-out sets hold (about 31k tokens)
    docs, _ = held_out_docs(tokenizer, HELD_OUT, min(64 * count * length, 24_000))
    long_enough = [d[:length] for d in docs if len(d) >= length]
    if len(long_enough) < count:
        raise ValueError(f"only {len(long_enough)} held-out documents have {length} tokens; {count} prompts asked")
    return [d[None] for d in long_enough[:count]]  # [1, P] each


def one_window(machine: VirtualMachine, log_start: int, window: int) -> list[tuple[str, str, float, float]]:
    """The clock's ops of the `window`-th speculative window of the first measured record (from the end
    of one verification to the end of the next), times relative to its start; the record's last window when it
    has fewer (a long K covers a short record in a window or two)."""
    ends = [f.end for f in machine.forwards if f.kind == "target" and f.end >= machine.clock.log[log_start][2]]
    if len(ends) < 2:
        return []
    window = min(window, len(ends) - 2)
    t0, t1 = ends[window], ends[window + 1]
    return [(s, op, a - t0, b - t0) for s, op, a, b in machine.clock.log[log_start:] if t0 <= a < t1]


# Load-efficiency columns of an engine row. loads_per_window_layer and retention_hits are the records' own (the mean
# over the measured records, per tiny layer and window: each real layer of a tiny layer's block sees the same hits and
# misses). loads_over_belady and belady_loads_per_token are the projection's (`decode_bound`): in real expert loads,
# over the decode only, like loads_per_token.
EXTRA_STATS = ("loads_per_window_layer", "retention_hits", "loads_over_belady", "belady_loads_per_token")
DECODE_STATS = ("loads_over_belady", "belady_loads_per_token")


def decode_routes(method) -> list[dict[int, set[int]]]:
    """The target's routes of the record just decoded, one dict per window after the prefill: a speculative
    engine's verification passes, an autoregressive method's steps (route-log window 0 is the prefill)."""
    if method.engine is not None:
        recorder = method.engine.recorder
        return [recorder.route_log.windows[w] for w in recorder.verify_windows]
    return list(method.route_log.windows[1:])


def decode_bound(machine: VirtualMachine, rt, windows: list[dict[int, set[int]]], start: dict[int, set[int]]) -> int:
    """The Belady bound (`predict.oracle`, the records' own) on a decode's real expert loads: per tiny MoE layer, the
    fewest loads any policy with the method's own M slots could do on the verified routes `windows`, starting from
    the residents `start` the prefill left; each stands for its block's b_j real layers (`VirtualMachine.block`).
    Staging buffers do not loosen it (see the oracle's docstring). A layer still holding a borrowed buffer at the
    start is given that many slots, which can only lower the bound."""
    from specter.predict.oracle import layer_min_loads

    layers = rt.om.moe_layers
    capacity = {layer: max(rt.cache.capacity(layer), len(start.get(layer, ()))) for layer in layers}
    per_layer = {layer: [w.get(layer, set()) for w in windows] for layer in layers}
    loads = layer_min_loads(per_layer, capacity, start)
    return sum(machine.block[layer] * n for layer, n in loads.items())


@dataclass
class Session:
    """A built method on a machine: what `measure` decodes with."""

    method: object
    machine: VirtualMachine
    handles: list


def open_method(cfg: DictConfig, checkpoint: Path, cm: CostModel, prepare=None) -> Session:
    """Build `cfg.method` with the harness's builder and attach a fresh machine; `prepare(method)` runs before
    attaching (e.g. a draft of another precision, whose calibration must not be charged)."""
    from specter.assembly.methods import build_method

    method = build_method(cfg, checkpoint)
    try:
        if prepare is not None:
            prepare(method)
        rt = method.rt
        layers = list(rt.om.moe_layers) if rt is not None else _moe_layers(method.model)
        machine = VirtualMachine(cm, layers)
        return Session(method, machine, attach(method, machine))
    except BaseException:
        method.close()
        raise


def set_K(session: Session, K: int) -> None:
    """The built method at draft length K: a new engine over the same runtime, draft and machine (what the
    builder would make at that K; building the method again per K of a profile costs seconds each)."""
    method = session.method
    if method.engine is None:
        raise TypeError(f"{type(method).__name__} has no draft length to set")
    method.set_draft_length(K)  # the new engine takes the machine's instruments the method was handed


def close(session: Session) -> None:
    for h in session.handles:
        h.remove()
    session.method.close()


def measure(session: Session, name: str, seed: int, prompts: list[torch.Tensor], new_tokens: int, warmup_tokens: int,
            timeline_window: int = 2) -> Projected:
    """One warm-up record, then each prompt from the reset cache; TPOT per the paper on the virtual clock."""
    method, machine = session.method, session.machine
    gen = torch.Generator().manual_seed(seed)
    method.reset()
    method.generate(prompts[0], warmup_tokens, gen)  # warm-up: the planner's estimates learn the clock
    method.warmed()
    decode_s, steps, loads, busy = 0.0, 0, 0, 0.0
    drafted = accepted = 0
    tokens: list[list[int]] = []
    timeline: list = []
    extra: dict[str, list[float]] = {k: [] for k in EXTRA_STATS}
    bound = 0  # Σ over records: the Belady bound on the decode's real loads (`decode_bound`)
    rt = method.rt
    speculative = is_method(name, speculative=True)
    for i, prompt in enumerate(prompts):
        method.reset()
        machine.clock.sync()  # records do not overlap: the previous one's copies have landed
        f0, log0 = len(machine.forwards), len(machine.clock.log)
        start: dict[int, set[int]] = {}
        if rt is not None:  # the residents when the prefill's forward ends: where the decode starts from
            machine.on_target_head = lambda start=start, cache=rt.cache: start.update(
                {layer: cache.resident(layer) for layer in cache.layers})
        out = method.generate(prompt, new_tokens, gen)
        machine.on_target_head = None
        ends = [f.end for f in machine.forwards[f0:] if f.kind == "target"]
        first, last = ends[0], ends[-1]
        decode_s += last - first
        steps += len(out.tokens) - 1
        loads += machine.real_loads(since=first)
        if rt is not None:
            bound += decode_bound(machine, rt, decode_routes(method), start)
        busy += machine.copy_busy(first, last)
        drafted += int(out.stats.get("drafted_tokens") or 0)
        accepted += int(out.stats.get("accepted_tokens") or 0)
        for key in EXTRA_STATS:
            if out.stats.get(key) is not None:
                extra[key].append(float(out.stats[key]))
        tokens.append(list(out.tokens))
        last_targets = len(ends)
        if i == 0 and speculative:
            timeline = one_window(machine, log0, timeline_window)
    log = method.route_log
    stats = {k: sum(v) / len(v) for k, v in extra.items() if v and k not in DECODE_STATS}
    if rt is not None and steps:
        stats["belady_loads_per_token"] = bound / steps
        stats["loads_over_belady"] = loads / bound if bound else None
    return Projected(
        method=name, tpot=decode_s / steps if steps else None,
        loads_per_token=loads / steps if steps and rt is not None else None,
        copy_busy=busy / decode_s if decode_s and rt is not None else None,
        acceptance=accepted / drafted if speculative and drafted else None,
        resident=int(rt.resident) if rt is not None else None, staging=int(rt.cache.staging) if rt is not None else 0,
        tokens=tokens, timeline=timeline, route_windows=list(log.windows) if log is not None else [],
        decode_forwards=last_targets, machine=machine, K=method.K,
        extra={k: v for k, v in stats.items() if v is not None},
        residency=str(rt.cache.residency) if rt is not None else "")


def run_method(cfg: DictConfig, checkpoint: Path, cm: CostModel, prompts: list[torch.Tensor], new_tokens: int,
               warmup_tokens: int, slots: tuple[int | None, int], timeline_window: int = 2, prepare=None) -> Projected:
    """Build `cfg.method` with the harness's builder, attach the machine, decode the prompts; the projection."""
    session = open_method(cfg, checkpoint, cm, prepare)
    try:
        return measure(session, str(cfg.method.name), int(cfg.seed), prompts, new_tokens, warmup_tokens,
                       timeline_window)
    finally:
        close(session)


def _moe_layers(model: torch.nn.Module) -> list[int]:
    from specter.models.arch import moe_blocks

    return sorted(moe_blocks(model))
