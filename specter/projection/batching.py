"""Batched decoding on the virtual clock (the paper's Figs. 15/16 and Table 3, projected).

The method's own batched loop runs: `Specter.generate_batch` (one engine; SpecMoEOff decodes two
microbatches over one cache), per-request KV rows, each request's acceptance and rollback. B requests
share every forward and every expert load; what grows with B is each pass's tokens (charged by the cost
model at the real model's sizes: attention, router, shared experts and lm_head on B x (K+1) tokens, each
routed expert on the tokens routed to it) and the verification working set, hence the loads. Each
request's commits are stamped on the compute stream (`virtual.VirtualCommitClock`), so TPOT is the
paper's per request, (last commit - first commit) / (tokens - 1), averaged over the batch, and throughput
is the batch's tokens over its span (first admission to last commit).

Not charged: attention's reads of the KV cache (the cost model leaves them out at B = 1, where they are a
few MB; at B = 32 and 144 positions they are about 0.14 GB per pass for DeepSeek-V2-Lite's MLA cache and
0.9 GB for Qwen1.5-MoE's: 0.11 and 0.73 ms per pass at the A100 file's effective HBM bandwidth), so large-B
TPOTs are a little low, Qwen's most.
The slots stay the B = 1 plan's at every B (the paper's budgets are labels; its KV fits beside them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specter.projection.engine_run import Session

BATCH_FIELDS = ("model", "memory", "device", "draft", "method", "K", "batch_size", "requests", "new_tokens", "tpot_ms",
                "throughput_tok_s", "loads_per_token", "acceptance", "working_set", "tpot_vs_b1", "throughput_vs_b1")


@dataclass
class BatchPoint:
    B: int
    tpot: float  # seconds: mean per-request TPOT
    throughput: float  # tokens per second over the batch's span
    loads_per_token: float  # real expert copies per generated token
    acceptance: float | None  # accepted / drafted over the batch's requests
    working_set: float | None  # distinct experts per MoE layer per verification pass
    tokens: int
    K: int | None
    outputs: list[list[int]]  # each request's tokens, in prompt order


def prepare_batching(method) -> None:
    """The batch engines exist before the machine is attached, so `attach` puts them on the clock too."""
    if method.engine is not None:
        method.build_batch_engines()


def run_batches(session: Session, seed: int, prompts: list[torch.Tensor], sizes: list[int], new_tokens: int,
                warmup_tokens: int, progress=print) -> list[BatchPoint]:
    """For each B: the first B prompts decoded together from the reset cache."""
    method, machine = session.method, session.machine
    if len(prompts) < max(sizes):
        raise ValueError(f"batch size {max(sizes)} needs {max(sizes)} prompts, {len(prompts)} given")
    method.reset()
    method.generate_batch(prompts[:1], warmup_tokens, [torch.Generator().manual_seed(seed)])  # warm-up
    method.warmed()
    points = []
    for B in sorted(set(sizes)):
        method.reset()
        t0 = machine.clock.sync()  # batches do not overlap: the previous one's copies have landed
        gens = [torch.Generator().manual_seed(seed + i) for i in range(B)]
        run = method.generate_batch(prompts[:B], new_tokens, gens)
        tpots = [t for r in run.requests if (t := r.clock.latency()["tpot_ms"]) is not None]
        tokens = sum(len(r.tokens[: r.max_new_tokens]) for r in run.requests)
        drafted = sum(sum(r.drafted) for r in run.requests)
        accepted = sum(sum(r.accepted) for r in run.requests)
        point = BatchPoint(B, sum(tpots) / len(tpots) / 1e3, tokens / run.wall_seconds(),
                           machine.real_loads(since=t0) / tokens, accepted / drafted if drafted else None,
                           run.stats.get("distinct_experts_per_layer"), tokens, run.stats.get("K"), run.tokens)
        points.append(point)
        progress(f"    B={B}: TPOT {point.tpot * 1e3:.2f} ms, {point.throughput:.1f} tokens/s, "
                 f"{point.loads_per_token:.1f} loads/token")
    return points


def batch_rows(name: str, points: list[BatchPoint], base: dict[str, str]) -> list[dict[str, str]]:
    one = next((p for p in points if p.B == 1), None)
    rows = []
    for p in points:
        rows.append({**base, "method": name, "K": "" if p.K is None else str(p.K), "batch_size": str(p.B),
                     "requests": str(p.B), "new_tokens": str(p.tokens), "tpot_ms": f"{p.tpot * 1e3:.4f}",
                     "throughput_tok_s": f"{p.throughput:.4f}", "loads_per_token": f"{p.loads_per_token:.4f}",
                     "acceptance": "" if p.acceptance is None else f"{p.acceptance:.4f}",
                     "working_set": "" if p.working_set is None else f"{p.working_set:.4f}",
                     "tpot_vs_b1": f"{p.tpot / one.tpot:.4f}" if one else "",
                     "throughput_vs_b1": f"{p.throughput / one.throughput:.4f}" if one else ""})
    return rows
