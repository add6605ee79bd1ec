"""Drafts of several precisions for the projection's α curve: GPTQ or RTN at 2, 3 or 4 bits and a group size.

Why they fit the engine unchanged: a symmetric b-bit grid per group, {(c - 2^(b-1)) * s : c in 0 .. 2^b - 1}
with s = 2 * absmax / (2^b - 1), is a subset of the INT4 container's grid {(c4 - 8) * s : c4 in 0 .. 15}
(c4 = c + 8 - 2^(b-1)). So a b-bit draft is stored as an ordinary `Int4Experts` and runs through the same
draft kernels; only its codes use fewer levels. The projection charges every draft the paper's INT4 g128
bytes and time (`cost_model.draft_experts`), so along the curve only the acceptance moves.

GPTQ is the project's reference transcription (`specter.quant.gptq.gptq_reference`, which its tests hold to
gptqmodel's) on the b-bit grid, batched over a layer's experts (`gptq_batched`); gate_up first, down from the
quantized gate_up's outputs (true-sequential, as `specter.quant.gptq` does at 4 bits); the calibration inputs
are the hidden states the target routes to each expert on the run's calibration prompts.
Each draft is cached under $SPECTER_HOME/drafts/ keyed by the weights, the calibration tokens and the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specter.quant.int4 import (ZERO_POINT, Int4ExpertLayer, Int4Experts, _round_scale_up, concat_experts,
                                default_group_size, dequantize, pack_codes)

ALGOS = ("gptq", "rtn")
BITS = (2, 3, 4)
_SPEC = re.compile(r"^(gptq|rtn)([234])g(\d+)$")


@dataclass(frozen=True)
class DraftSpec:
    algo: str  # gptq | rtn
    bits: int
    group: int

    @property
    def name(self) -> str:
        """How a table names the draft, e.g. "GPTQ INT4 g128"."""
        return f"{self.algo.upper()} INT{self.bits} g{self.group}"

    @property
    def key(self) -> str:
        return f"{self.algo}{self.bits}g{self.group}"


PAPER_DRAFT = DraftSpec("gptq", 4, 128)  # the paper's: all routed-expert linears symmetric INT4, group 128


def parse_draft(text: str) -> DraftSpec:
    """"gptq3g64" -> DraftSpec("gptq", 3, 64); a ValueError names the accepted form."""
    m = _SPEC.match(str(text).strip().lower())
    if not m or int(m.group(3)) < 8 or int(m.group(3)) & (int(m.group(3)) - 1):
        raise ValueError(f"draft {text!r}: expected <gptq|rtn><bits 2-4>g<group, a power of two >= 8>, e.g. gptq4g128")
    return DraftSpec(m.group(1), int(m.group(2)), int(m.group(3)))


def grid(bits: int) -> tuple[int, int]:
    """(largest b-bit code, its zero point)."""
    return 2**bits - 1, 2 ** (bits - 1)


def to_container(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit codes (0 .. 2^b - 1, zero point 2^(b-1)) as INT4 container codes (zero point 8)."""
    return codes + (ZERO_POINT - grid(bits)[1])


def rtn_bits(w: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype = torch.float16) -> Int4Experts:
    """Round-to-nearest of an expert stack w [E, N, K] on the symmetric b-bit grid (b = 4: `quantize_rtn`'s)."""
    e, n, k = w.shape
    maxq, zero = grid(bits)
    wg = w.detach().float().reshape(e, n, k // group, group)  # [E, N, G, gs]
    amax = wg.abs().amax(-1)  # [E, N, G]
    scale = torch.where(amax > 0, amax * (2.0 / maxq), torch.ones_like(amax))
    scale = _round_scale_up(scale, scale_dtype)  # [E, N, G], rounded up: no weight falls off the grid
    codes = torch.clamp(torch.round(wg / scale.float().unsqueeze(-1)) + zero, 0, maxq)  # [E, N, G, gs]
    return Int4Experts(pack_codes(to_container(codes, bits).reshape(e, n, k)), scale, group, method="rtn")


def gptq_batched(w: torch.Tensor, xs: list[torch.Tensor], bits: int, group: int, damp_percent: float = 0.01,
                 block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of E linears at once, w [E, N, K] from inputs xs[e] [n_e >= 1, K] -> (b-bit codes [E, N, K],
    fp32 scales [E, N, K/group]).

    `specter.quant.gptq.gptq_reference` step for step (H = 2XᵀX/n, dampening, Cholesky of H⁻¹, column by
    column with error feedback, a group's scale fixed from W as updated up to its block's start), on the
    b-bit grid and batched over the experts: one pass over the K columns per layer instead of one per
    expert, which is what makes several drafts per proxy affordable on a CPU (tests check it against the
    reference at 4 bits)."""
    E, n_out, k = w.shape
    maxq, zero = grid(bits)
    W = w.detach().float().clone()
    H = torch.stack([x.float().reshape(-1, k).t() @ x.float().reshape(-1, k) * (2.0 / x.shape[0]) for x in xs])
    dead = torch.diagonal(H, dim1=1, dim2=2) == 0  # [E, K]
    H = H + torch.diag_embed(dead.float())  # H[e, d, d] = 1 where column d saw no input
    W = W.masked_fill(dead[:, None, :], 0.0)
    H = H + torch.diag_embed(damp_percent * torch.diagonal(H, dim1=1, dim2=2).mean(-1, keepdim=True).expand(E, k))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # [E, K, K]
    codes = torch.zeros(E, n_out, k, dtype=torch.uint8)
    scales = torch.zeros(E, n_out, k // group)
    scale = torch.ones(E, n_out)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        W1, Err1, Hinv1 = W[:, :, b0:b1].clone(), torch.zeros(E, n_out, b1 - b0), Hinv[:, b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group == 0:
                amax = W[:, :, col:col + group].abs().amax(-1)  # [E, N]
                scale = torch.where(amax > 0, amax * (2.0 / maxq), torch.ones_like(amax))
                scales[:, :, col // group] = scale
            wcol = W1[:, :, i]  # [E, N]
            q = torch.clamp(torch.round(wcol / scale) + zero, 0, maxq)
            codes[:, :, col] = q.to(torch.uint8)
            err = (wcol - (q - zero) * scale) / Hinv1[:, i, i][:, None]  # [E, N]
            W1[:, :, i:] -= err[:, :, None] * Hinv1[:, None, i, i:]
            Err1[:, :, i] = err
        W[:, :, b1:] -= Err1 @ Hinv[:, b0:b1, b1:]
    return codes, scales


def _packed(codes: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
            scale_dtype: torch.dtype = torch.float16) -> Int4Experts:
    """b-bit codes [E, N, K] and fp32 scales in the INT4 container (the codes stay; the scales are stored in
    `scale_dtype`, as `specter.quant.gptq` stores its own)."""
    return Int4Experts(pack_codes(to_container(codes.long(), bits)), scales.to(scale_dtype), group, method="gptq")


def quantize_layer(gate_up, down, inputs, act_fn, spec: DraftSpec) -> Int4ExpertLayer:
    """One MoE layer's routed experts at `spec`. gate_up[e] [2I, H], down[e] [H, I], inputs[e] [n_e, H] (GPTQ
    only: gate_up from them, down from the quantized gate_up's activations, true-sequential as at 4 bits; an
    expert with no calibration token falls back to RTN, as at 4 bits)."""
    hidden, inter = gate_up[0].shape[1], down[0].shape[1]
    gs_gu, gs_dn = default_group_size(hidden, spec.group), default_group_size(inter, spec.group)
    gu_w, dn_w = torch.stack([g.float() for g in gate_up]), torch.stack([d.float() for d in down])
    gu, dn = rtn_bits(gu_w, spec.bits, gs_gu), rtn_bits(dn_w, spec.bits, gs_dn)
    if spec.algo == "rtn":
        return Int4ExpertLayer(gu, dn)
    seen = [e for e in range(len(gate_up)) if inputs[e].numel()]
    fallback = tuple(e for e in range(len(gate_up)) if e not in seen)
    if seen:
        xs = [inputs[e].reshape(-1, hidden).float() for e in seen]
        gu_s = _packed(*gptq_batched(gu_w[seen], xs, spec.bits, gs_gu), spec.bits, gs_gu)
        w_gu = dequantize(gu_s, torch.float32)  # [S, 2I, H]: what the draft computes with
        acts = []
        for j, x in enumerate(xs):
            gate, up = (x @ w_gu[j].t()).chunk(2, dim=-1)  # [n_e, I] each
            acts.append(act_fn(gate) * up)
        dn_s = _packed(*gptq_batched(dn_w[seen], acts, spec.bits, gs_dn), spec.bits, gs_dn)
        idx = torch.tensor(seen)
        for full, part in ((gu, gu_s), (dn, dn_s)):
            full.qweight[idx], full.scales[idx] = part.qweight, part.scales.to(full.scales.dtype)
    return Int4ExpertLayer(*(Int4Experts(p.qweight, p.scales, p.group_size, method="gptq",
                                         rtn_fallback_experts=fallback) for p in (gu, dn)))


def draft_layers(rt, spec: DraftSpec, batches: list[torch.Tensor], cache: Path | None) -> dict[int, Int4ExpertLayer]:
    """Every MoE layer of `rt`'s model at `spec`: loaded from `cache` when built before, else quantized (and saved)."""
    from specter.quant.calibration import capture_expert_inputs, load_draft, save_draft
    from specter.quant.draft import layer_weights

    if cache is not None and cache.exists() and cache.with_suffix(".sha256").exists():
        return load_draft(cache)
    inputs = capture_expert_inputs(rt, batches) if spec.algo == "gptq" else {}
    layers = {}
    for layer in rt.om.moe_layers:
        gate_up, down = layer_weights(rt.om.store, layer)
        layers[layer] = quantize_layer(gate_up, down, inputs.get(layer, [torch.zeros(0)] * len(gate_up)),
                                       rt.om.experts[layer].act_fn, spec)
    if cache is not None:
        save_draft(cache, layers)
    return layers


def install_draft(method, spec: DraftSpec) -> None:
    """Replace a built speculative method's INT4 draft experts with `spec`'s (the shared instance's and, for a
    separate draft instance, that one's); cached beside the method's own GPTQ draft."""
    from transformers import AutoTokenizer

    from specter.assembly.runtime import calibration_batches
    from specter.paths import specter_home
    from specter.quant.calibration import calibration_digest
    from specter.quant.draft import build_draft

    rt = method.rt
    batches = calibration_batches(method.spec.calibration, AutoTokenizer.from_pretrained(method.checkpoint),
                                  rt.cache.device)
    key = calibration_digest(batches)[:12] if spec.algo == "gptq" else "none"
    cache = specter_home() / "drafts" / f"{method.spec.model}-{rt.weights_digest[:12]}" / f"{spec.key}-{key}.safetensors"
    layers = draft_layers(rt, spec, batches, cache)  # calibration runs from the host store: never charged
    built = build_draft(rt.om, spec.algo, method.device, method.dtype, packed_layers=layers,
                        kernel=method.kernel_choice.selected)
    runtimes = [rt.moe, method.draft_moe]  # the shared instance; a separate draft instance
    tables = {id(m.draft.experts): m.draft.experts for m in runtimes if m is not None and m.draft is not None}
    if not tables:
        raise TypeError(f"{type(method).__name__} has no INT4 draft experts to replace")
    for experts in tables.values():
        experts.update(built)
