"""Compact MoE blocks of the three architectures: router, routed experts, shared expert.

The routed experts are the block's own experts module, called as
`experts(hidden [N,H], topk_idx [N,k], topk_w [N,k]) -> [N,H]`, so Specter's `SpecterExperts`
(offloading, ELB counting, expert-wise verification, the INT4 draft) plugs in unchanged. Only a
plain transformers fused experts module (every expert on the device, e.g. target_only) is
replaced by `FusedExperts` over its own tensors, which costs a few operators per route instead
of transformers' one-hot/nonzero/where loop.

Routers reproduce transformers' routing functions exactly (softmax top-k with optional
renormalisation; DeepSeek-V2's greedy / group-limited greedy with its scaling factor; PhiMoE's
sparsemixer top-2 in eval mode). Where the dtypes allow, the router and the shared expert's
gate/up (and Qwen2-MoE's shared-expert gate) read the normed input through one fused projection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specter.models.compact.ops import FusedExperts, GatedMLP, Proj, cols, fuse, glu, proj

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_of(module: torch.nn.Module, compact: bool = True) -> Experts:
    """The block's routed-experts callable: `FusedExperts` over a plain transformers module's tensors,
    else the module itself (SpecterExperts and anything else with the experts signature)."""
    if compact and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") \
            and isinstance(getattr(module, "gate_up_proj"), torch.Tensor) and module.gate_up_proj.device.type != "meta":
        return FusedExperts(module)
    return module


def _input_projection(router_weight_module: torch.nn.Module, extra: list[torch.nn.Module],
                      router_fp32: bool) -> tuple[Proj, Proj | None, bool]:
    """(fused projection, separate router projection or None, whether the router is fused in)."""
    dtype = router_weight_module.weight.dtype
    same = all(m.weight.dtype == dtype for m in extra) and (not router_fp32 or dtype == torch.float32)
    if same:
        return fuse([router_weight_module, *extra]), None, True
    return fuse(extra), proj(router_weight_module), False


class QwenMoE:
    """Qwen2-MoE: softmax top-k (optionally renormalised) + sigmoid-gated shared expert."""

    def __init__(self, block: torch.nn.Module, config, compact_experts: bool = True):
        router = block.gate
        self.E = router.weight.shape[0]
        self.top_k = int(getattr(router, "top_k", config.num_experts_per_tok))
        self.norm = bool(getattr(router, "norm_topk_prob", config.norm_topk_prob))
        self.experts = experts_of(block.experts, compact_experts)
        se = block.shared_expert
        self.inter = se.gate_proj.weight.shape[0]
        self.act = se.act_fn
        self.proj_in, self.router, fused = _input_projection(router, [se.gate_proj, se.up_proj, block.shared_expert_gate],
                                                             router_fp32=False)
        self.off = self.E if fused else 0
        self.down = proj(se.down_proj)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        a = self.proj_in(x)  # [N, (E) + 2I_s + 1]
        logits = cols(a, 0, self.E) if self.router is None else self.router(x)  # [N, E]
        probs = torch.softmax(logits, -1, dtype=torch.float32) if logits.dtype != torch.float32 else logits.softmax(-1)
        w, idx = torch.topk(probs, self.top_k, -1)  # [N, k]
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        routed = self.experts(x, idx, w if w.dtype == x.dtype else w.to(x.dtype))  # [N, H]
        o = self.off
        shared = self.down(glu(cols(a, o, 2 * self.inter), self.act, self.inter))  # [N, H]
        gate = torch.sigmoid(cols(a, o + 2 * self.inter, 1))  # [N, 1]
        return torch.addcmul(routed, shared, gate)


class DeepSeekMoE:
    """DeepSeek-V2: fp32 softmax, greedy or group-limited greedy top-k, routed scaling, shared experts."""

    def __init__(self, block: torch.nn.Module, config, compact_experts: bool = True):
        router = block.gate
        self.E = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.method = getattr(block, "topk_method", getattr(config, "topk_method", "greedy"))
        if self.method not in ("greedy", "group_limited_greedy"):
            raise NotImplementedError(f"DeepSeek-V2 topk_method {self.method!r}")
        self.groups, self.topk_group = config.n_group, config.topk_group
        self.scale = float(config.routed_scaling_factor)
        self.norm = bool(getattr(block, "norm_topk_prob", False))
        self.experts = experts_of(block.experts, compact_experts)
        se = block.shared_experts
        self.inter = se.gate_proj.weight.shape[0]
        self.act = se.act_fn
        self.proj_in, self.router, fused = _input_projection(router, [se.gate_proj, se.up_proj], router_fp32=True)
        self.off = self.E if fused else 0
        self.down = proj(se.down_proj)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.softmax(-1) if logits.dtype == torch.float32 else torch.softmax(logits, -1, dtype=torch.float32)
        if self.method == "group_limited_greedy":
            n = probs.shape[0]
            group_scores = probs.view(n, self.groups, -1).amax(-1)  # [N, G]
            group_idx = torch.topk(group_scores, self.topk_group, -1, sorted=False)[1]  # [N, g]
            keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()  # [N, G]
            probs = probs.masked_fill(~keep.repeat_interleave(self.E // self.groups, 1), 0.0)
        w, idx = torch.topk(probs, self.top_k, -1, sorted=False)  # [N, k]
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        a = self.proj_in(x)  # [N, (E) + 2I_s]
        logits = cols(a, 0, self.E) if self.router is None else self.router(x.float())  # [N, E] fp32
        idx, w = self.route(logits)
        routed = self.experts(x, idx, w)  # [N, H]
        o = self.off
        return routed + self.down(glu(cols(a, o, 2 * self.inter), self.act, self.inter))


class PhiMoE:
    """PhiMoE: sparsemixer top-2 routing (eval mode: no jitter sampling), no shared expert."""

    def __init__(self, block: torch.nn.Module, config, compact_experts: bool = True):
        router = getattr(block, "router", None) or block.gate
        self.router = proj(router)
        self.E = router.weight.shape[0]
        self.eps = float(getattr(router, "router_jitter_noise", config.router_jitter_noise))
        if int(getattr(config, "num_experts_per_tok", 2)) != 2:
            raise NotImplementedError("PhiMoE's sparsemixer routes exactly two experts per token")
        self.experts = experts_of(block.experts, compact_experts)
        w = router.weight
        self.band = torch.tensor(2 * self.eps, dtype=w.dtype, device=w.device)
        self.neg_inf = torch.tensor(float("-inf"), dtype=w.dtype, device=w.device)
        self.expert_ids = torch.arange(self.E, device=w.device)  # [E]
        self.second_row = torch.tensor([[False], [True]], device=w.device)  # [2, 1]

    def route(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparsemixer (eval), both picks at once: pick j's weight is a softmax over the logits within
        a relative 2·eps band of its logit, taken at the pick; the second pick's softmax excludes the
        first pick. scores [N, E] -> (idx [N, 2], w [N, 2])."""
        top, idx = torch.topk(scores, 2, -1)  # [N, 2]: the first pick, then the best of the rest
        thr = top.unsqueeze(-1)  # [N, 2, 1]
        s = scores.unsqueeze(1)  # [N, 1, E]
        out_of_band = torch.gt((thr - s) / torch.maximum(s.abs(), thr), self.band)  # [N, 2, E]
        first = torch.eq(self.expert_ids, idx[:, :1]).unsqueeze(1)  # [N, 1, E]
        out_of_band |= first & self.second_row  # the second softmax never sees the first pick
        w = torch.where(out_of_band, self.neg_inf, s).softmax(-1)  # [N, 2, E]
        return idx, w.gather(-1, idx.unsqueeze(-1)).view(-1, 2)  # [N, 2] each

    def route_reference(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' sparsemixer in eval mode, step by step (the slow reference of `route`)."""
        eps2 = 2 * self.eps
        top1, idx1 = scores.max(-1, keepdim=True)  # [N, 1]
        factor = scores.abs().clamp(min=top1)  # [N, E]
        masked = scores.masked_fill((top1 - scores) / factor > eps2, float("-inf"))  # [N, E]
        w1 = torch.softmax(masked, -1).gather(-1, idx1)  # [N, 1]
        rest = scores.scatter(-1, idx1, float("-inf"))  # [N, E]
        top2, idx2 = rest.max(-1, keepdim=True)  # [N, 1]
        factor2 = scores.abs().clamp(min=top2)
        masked2 = rest.masked_fill((top2 - scores) / factor2 > eps2, float("-inf"))
        w2 = torch.softmax(masked2, -1).gather(-1, idx2)  # [N, 1]
        return torch.cat([idx1, idx2], -1), torch.cat([w1, w2], -1)  # [N, 2] each

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        idx, w = self.route(self.router(x))
        return self.experts(x, idx, w if w.dtype == x.dtype else w.to(x.dtype))


class DenseMLP:
    """A dense decoder layer's MLP (gate/up fused)."""

    def __init__(self, mlp: GatedMLP):
        self.mlp = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)
