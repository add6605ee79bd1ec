"""The few tensor operations a compact layer is made of, each with as few torch operators as it takes.

Hidden states are 2-D `[N, H]` (N = B·T rows) everywhere outside attention, so every projection is a
single `mm`/`addmm` against a weight view transposed once at build time (no copy): `F.linear`
costs about ten dispatched operators per call on CPU, `addmm` one. The slow references these are
tested against are transformers' own modules (tests/test_compact_vs_hf.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Proj:
    """y = x @ W^T (+ b) as one `mm`/`addmm`; `wt` is a transposed view of the checkpoint weight."""

    wt: torch.Tensor  # [in, out] (a view)
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [N, in] -> [N, out]
        if self.bias is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.bias, x, self.wt)

    @property
    def out_features(self) -> int:
        return self.wt.shape[1]


def proj(linear: torch.nn.Module) -> Proj:
    return Proj(linear.weight.t(), getattr(linear, "bias", None))


def fuse(linears: Sequence[torch.nn.Module]) -> Proj:
    """One projection for several linears that read the same input.

    The weights (and biases) are concatenated once into one buffer and every linear's own
    parameter is re-pointed at its slice of it, so the model keeps a single copy of each weight
    and the transformers modules keep computing exactly what they did.
    """
    if len(linears) == 1:
        return proj(linears[0])
    weights = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        raise ValueError("fused linears must share dtype, device and input size")
    fused_w = torch.cat([w.detach() for w in weights], 0)  # [sum(out), in]
    biases = [getattr(m, "bias", None) for m in linears]
    fused_b = None
    if any(b is not None for b in biases):
        fused_b = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                             for m, b in zip(linears, biases)])  # [sum(out)]
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused_w[start:start + n], requires_grad=False)
        if getattr(m, "bias", None) is not None:
            m.bias = torch.nn.Parameter(fused_b[start:start + n], requires_grad=False)
        start += n
    return Proj(fused_w.t(), fused_b)


def cols(a: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """a[:, start:start+width] of a 2-D tensor as one `as_strided` (indexing costs two operators;
    under torch.compile, where operators cost nothing, the plain slice that the tracer understands)."""
    if torch.compiler.is_compiling():
        return a[:, start:start + width]
    return a.as_strided((a.shape[0], width), (a.stride(0), a.stride(1)), a.storage_offset() + start * a.stride(1))


def seq(buf: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """buf[:, :, start:start+length] of a [B, H, S, D] buffer as one `as_strided` (narrow costs three)."""
    b, h, _, d = buf.shape
    st = buf.stride()
    return buf.as_strided((b, h, length, d), st, buf.storage_offset() + start * st[2])


class RMSNorm:
    """transformers' RMSNorm (fp32 statistics, weight applied in the input dtype) in seven operators;
    the constants are 0-dim tensors so no Python scalar is wrapped per call."""

    def __init__(self, module: torch.nn.Module):
        self.weight = module.weight  # [H]
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        self.eps = torch.tensor(eps, dtype=torch.float32, device=self.weight.device)
        self.size = torch.tensor(float(self.weight.shape[0]), dtype=torch.float32, device=self.weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        xf = x.float() if x.dtype != torch.float32 else x
        var = torch.sum(xf * xf, -1, keepdim=True).div_(self.size).add_(self.eps).rsqrt_()  # [N, 1]
        y = xf * var
        return self.weight * (y.to(x.dtype) if x.dtype != torch.float32 else y)


class LayerNorm:
    """A LayerNorm with bias (PhiMoE's norms)."""

    def __init__(self, module: torch.nn.LayerNorm):
        self.shape = tuple(module.normalized_shape)
        self.weight, self.bias, self.eps = module.weight, module.bias, module.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def norm_of(module: torch.nn.Module) -> RMSNorm | LayerNorm:
    return LayerNorm(module) if isinstance(module, torch.nn.LayerNorm) else RMSNorm(module)


# ----------------------------------------------------------------------------------------- rope
class Rope:
    """Rotary embedding as `x·cos + (x @ R)·sin` with per-position tables.

    R is the fixed signed permutation that pairs dimensions: the half split of Llama-style rope
    (`rotate_half`) or adjacent pairs (DeepSeek-V2's complex form). The tables come from the
    checkpoint's own rotary module, so every rope variant transformers implements (default,
    linear, YaRN, llama3, longrope with its attention scaling) is reproduced as-is.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
        self.cos, self.sin = cos, sin  # [S, D] each
        d = cos.shape[-1]
        r = torch.zeros(d, d, dtype=cos.dtype, device=cos.device)
        idx = torch.arange(d // 2, device=cos.device)
        if interleaved:  # (x0, x1) -> (-x1, x0) on adjacent pairs
            r[2 * idx + 1, 2 * idx] = -1
            r[2 * idx, 2 * idx + 1] = 1
        else:  # rotate_half: (x1, x2) -> (-x2, x1)
            r[idx + d // 2, idx] = -1
            r[idx, idx + d // 2] = 1
        self.rot = r  # [D, D]
        # the same rotation as a gather and a sign, for the compiled step (fused; no extern product)
        self.partner = r.abs().argmax(0)  # [D] column j of x @ R reads x[partner[j]]
        self.sign = r.sum(0)  # [D] +-1

    @property
    def length(self) -> int:
        return self.cos.shape[0]

    def tables(self, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] of positions start..start+T-1."""
        return self.cos.narrow(0, start, t)[:, None], self.sin.narrow(0, start, t)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, n, D]; cos/sin [T, 1, D] of its positions (broadcast over rows and heads)."""
        xr = torch.mm(x.reshape(-1, x.shape[-1]), self.rot).view(x.shape)  # [B, T, n, D] pairs swapped, signed
        return torch.addcmul(x * cos, xr, sin)  # [B, T, n, D]

    def apply_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [R, D] (contiguous rows) whose rows broadcast against cos/sin [R or 1, D]."""
        if torch.compiler.is_compiling():
            return torch.addcmul(x * cos, x.index_select(-1, self.partner) * self.sign, sin)
        return torch.addcmul(x * cos, torch.mm(x, self.rot), sin)


def rope_tables(rotary: torch.nn.Module, length: int, device: torch.device, dtype: torch.dtype,
                complex_form: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, D] from a transformers rotary module, evaluated the way decoding evaluates it.

    Rope types whose frequencies depend on the sequence reached so far (longrope) switch once at
    `original_max_position_embeddings`; positions on either side are computed in separate calls,
    as one-token decoding does. Dynamic-NTK scaling depends on every call's length and is refused.
    """
    rope_type = getattr(rotary, "rope_type", "default")
    if "dynamic" in str(rope_type):
        raise NotImplementedError(f"rope type {rope_type!r} rescales with each call's length; "
                                  "use the transformers decode path for it")
    probe = torch.zeros(1, device=device, dtype=dtype)
    params = getattr(rotary.config, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    bounds = [0, original, length] if original and original < length else [0, length]
    cos_parts, sin_parts = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        pos = torch.arange(lo, hi, device=device)[None]  # [1, n]
        out = rotary(probe, pos)
        if complex_form:  # DeepSeek-V2: complex freqs_cis [1, n, D/2], attention scaling folded in
            f = out[0]
            cos_parts.append(f.real.repeat_interleave(2, -1))
            sin_parts.append(f.imag.repeat_interleave(2, -1))
        else:
            cos_parts.append(out[0][0])
            sin_parts.append(out[1][0])
    return torch.cat(cos_parts).to(dtype), torch.cat(sin_parts).to(dtype)  # [length, D] each


# ------------------------------------------------------------------------------------ attention
def causal_mask(past: int, t: int, device: torch.device, dtype: torch.dtype,
                window: int | None = None) -> torch.Tensor | None:
    """Additive [T, past+T] mask (0 = attend, -inf = not) for T new positions after `past` cached
    ones; with a sliding `window`, position q sees keys q-window < k <= q (transformers' rule).
    None when every new position sees every cached one (one token inside the window)."""
    if t == 1 and (window is None or past + 1 <= window):
        return None
    q = torch.arange(past, past + t, device=device)[:, None]  # [T, 1]
    k = torch.arange(past + t, device=device)[None]  # [1, past+T]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           t: int) -> torch.Tensor:
    """Grouped attention as plain batched products (a handful of operators; SDPA costs ~70 on CPU).

    q [G_b, g·T, D] with rows ordered (query head within its group, position); k [G_b, S, D];
    v [G_b, S, D_v]; G_b = batch x KV heads. mask: additive [T, S] or None. -> [G_b, g·T, D_v].
    Softmax in fp32, as transformers' eager attention.
    """
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # [G_b, g*T, S]
    if mask is not None:
        gb, rows, s = scores.shape
        scores = scores.view(gb, rows // t, t, s).add_(mask).view(gb, rows, s)
    p = torch.softmax(scores, -1) if scores.dtype == torch.float32 else torch.softmax(scores, -1, dtype=torch.float32)
    return torch.bmm(p.to(v.dtype) if p.dtype != v.dtype else p, v)  # [G_b, g*T, D_v]


# -------------------------------------------------------------------------------------- experts
def glu(h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], inter: int) -> torch.Tensor:
    """act(gate) * up for h = [gate | up] along the last dim of a 2-D [N, 2I] tensor."""
    return act(cols(h, 0, inter)).mul_(cols(h, inter, inter))


@dataclass
class GatedMLP:
    """A dense gated MLP (dense layers, shared experts): fused gate/up, then down."""

    gate_up: Proj
    down: Proj
    inter: int
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down(glu(self.gate_up(x), self.act, self.inter))


def gated_mlp(module: torch.nn.Module) -> GatedMLP:
    """From a transformers MLP with gate_proj / up_proj / down_proj / act_fn (gate and up fused)."""
    return GatedMLP(fuse([module.gate_proj, module.up_proj]), proj(module.down_proj),
                    module.gate_proj.weight.shape[0], module.act_fn)


class FusedExperts:
    """Routed experts over a transformers fused experts module's own `gate_up_proj [E, 2I, H]` and
    `down_proj [E, H, I]` (per-expert views taken once; no copy).

    One token: a loop over its k routes, five operators each (gate and up mat-vecs, act, product,
    an accumulating `addmv_` scaled by the route's weight).
    More tokens: tokens grouped by expert, one `mm` pair per expert hit, accumulated in the
    routes' order (as transformers does, up to summation order).
    """

    def __init__(self, module: torch.nn.Module):
        gate_up, down = module.gate_up_proj, module.down_proj  # [E, 2I, H], [E, H, I]
        self.gate_up, self.down_all = gate_up, down
        self.inter = down.shape[-1]
        self.gate = list(gate_up[:, :self.inter].unbind(0))  # E x [I, H] views
        self.up = list(gate_up[:, self.inter:].unbind(0))  # E x [I, H] views
        self.down = list(down.unbind(0))  # E x [H, I]
        self.gate_up_t = [w.t() for w in gate_up.unbind(0)]  # E x [H, 2I]
        self.down_t = [w.t() for w in self.down]  # E x [I, H]
        self.num_experts = len(self.gate)
        self.act = module.act_fn
        self.silu = isinstance(self.act, torch.nn.SiLU)
        self.scratch = gate_up.new_empty(self.inter)  # ignored input of the beta=0 products
        self.zero_h = gate_up.new_empty(gate_up.shape[-1])

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # x [N, H], topk_idx / topk_w [N, k]
        if n == 1:  # five operators per route: two mat-vecs, act, product, accumulating mat-vec
            x1 = x.view(-1)  # [H]
            out = None
            for e, w in zip(topk_idx.view(-1).tolist(), topk_w.view(-1).tolist()):
                if e >= self.num_experts:  # a dropped route ("no expert")
                    continue
                g = torch.addmv(self.scratch, self.gate[e], x1, beta=0)  # [I]
                u = torch.addmv(self.scratch, self.up[e], x1, beta=0)  # [I]
                h = (torch.nn.functional.silu(g, inplace=True) if self.silu else self.act(g)).mul_(u)  # [I]
                if out is None:
                    out = torch.addmv(self.zero_h, self.down[e], h, beta=0, alpha=w)  # [H]
                else:
                    out.addmv_(self.down[e], h, alpha=w)
            return torch.zeros_like(x) if out is None else out.view(1, -1)  # [1, H]
        out = torch.zeros_like(x)  # [N, H]
        flat = topk_idx.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # routes grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
        tok = (order // topk_idx.shape[1])  # [N*k] token of each sorted route
        w_sorted = topk_w.reshape(-1)[order]  # [N*k]
        start = 0
        for e, c in enumerate(counts[:self.num_experts]):
            if c == 0:
                continue
            rows = tok[start:start + c]  # [c]
            h = glu(torch.mm(x[rows], self.gate_up_t[e]), self.act, self.inter)  # [c, I]
            y = torch.mm(h, self.down_t[e]) * w_sorted[start:start + c, None].to(x.dtype)  # [c, H]
            out.index_add_(0, rows, y)
            start += c
        return out


class GatheredExperts:
    """Routed experts as indexed reductions, `sum_h W[idx, i, h] · x[h]`, with static shapes and no
    host sync: under torch.compile the gather fuses into the reduction, so only the routed experts'
    weights are read and nothing is copied; on a GPU the step is capturable. Eager, it materialises
    the gathered weights (slow; `FusedExperts` is the eager path). Dropped routes (index >= E)
    read expert E-1 with weight 0. Same signature as every experts callable:
    (x [N, H], topk_idx [N, k], topk_w [N, k]) -> [N, H]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]):
        self.gate_up, self.down, self.act = gate_up, down, act  # [E, 2I, H], [E, H, I]
        self.inter, self.num_experts = down.shape[-1], gate_up.shape[0]

    @classmethod
    def of(cls, experts: FusedExperts) -> "GatheredExperts":
        return cls(experts.gate_up, experts.down_all, experts.act)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        idx = topk_idx.clamp(max=self.num_experts - 1)  # [N, k]
        w = torch.where(topk_idx < self.num_experts, topk_w, 0).to(x.dtype)  # [N, k]
        gu = (self.gate_up[idx] * x[:, None, None, :]).sum(-1)  # [N, k, 2I]
        h = self.act(gu[..., :self.inter]) * gu[..., self.inter:]  # [N, k, I]
        y = (self.down[idx] * h[..., None, :]).sum(-1)  # [N, k, H]
        return (y * w[..., None]).sum(1)  # [N, H]
