"""MoE-Spec (McDanel et al., 2026) verification-time expert budgeting on Specter: `method=moe_spec`.

Specter's speculative engine unchanged, except in each verification pass: per MoE layer, rank the
experts by their full-softmax routing probability summed over ALL of the pass's tokens (MoE-Spec's
Algorithm 1: ``score_e = Σ_t softmax(router_logits_t)_e``) and keep the top B (`method.budget`);
a route to a dropped expert is

    truncate    removed, and the token's kept weights rescaled to its original total weight
    substitute  sent to the best-ranked kept expert the token does not already use, same weight
                (removed when the token already uses every kept expert)

Fewer distinct experts per window means fewer loads, at the cost of acceptance and of output
quality: the method is lossy and is not held to token equality. Its records carry, computed after
generation and outside timing, `first_divergence` and `token_match_fraction` against target-only
greedy decoding of the same prompt, and `target_nll`, the target's mean negative log-likelihood of
the generated tokens. A pass whose routed experts are all among the top B is left untouched, and
with B = E nothing is ever dropped: the method is Specter exactly. The prefill is not a
verification and runs the full router.

The budget also caps the planner: a verification computes at most B experts per layer, so a
window's plan keeps at most min(M + staging share, B) experts per layer (`plan_cap`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from specter.assembly.config import ConfigError
from specter.assembly.methods import Specter
from specter.models.arch import moe_blocks
from specter.spec import MethodSpec
from specter.speculative.autoregressive import generate_autoregressive

BUDGET_MODES = ("truncate", "substitute")


class ExpertBudget:
    """The verifier's expert filter: keep each layer's top-B experts by summed full-softmax probability.

    The router probabilities come from forward hooks on the model's routers (`watch`), or are
    passed in (``router_probs [T, E]``)."""

    def __init__(self, budget: int, mode: str, num_experts: int):
        if mode not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {mode!r}; choose one of {BUDGET_MODES}")
        self.budget, self.mode, self.num_experts = budget, mode, num_experts
        self.router_logits: dict[int, torch.Tensor] = {}  # MoE layer -> its router's last logits [T, E]

    def watch(self, model: torch.nn.Module) -> None:
        """Keep every MoE layer's router logits as the router computes them (read by the filter)."""
        for layer, block in moe_blocks(model).items():
            router = block.gate if hasattr(block, "gate") else block.router
            router.register_forward_hook(self._recorder(layer))

    def _recorder(self, layer: int):
        def record(module, args, out) -> None:
            self.router_logits[layer] = out[0] if isinstance(out, tuple) else out  # [T, E]
        return record

    def ranking(self, router_probs: torch.Tensor) -> torch.Tensor:
        """The top-B expert ids of a pass ``[B]``, by ``Σ_t router_probs[t, e]``; ties go to the lower id."""
        score = router_probs.float().sum(0)  # [E]
        return torch.sort(score, descending=True, stable=True).indices[: self.budget]

    def __call__(self, layer: int, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 router_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        E = self.num_experts
        if self.budget >= E:
            return topk_idx, topk_w
        if router_probs is None:
            logits = self.router_logits.pop(layer, None)
            if logits is None or logits.shape[0] != topk_idx.shape[0]:
                raise RuntimeError(f"layer {layer}: no router logits for the {topk_idx.shape[0]} routed tokens "
                                   "(call watch(model) before decoding)")
            router_probs = F.softmax(logits.float(), dim=-1)  # [T, E], the full softmax
        ranked = self.ranking(router_probs)  # [B]
        kept = torch.zeros(E + 1, dtype=torch.bool, device=topk_idx.device)  # [E+1]; E = "no expert"
        kept[ranked.to(topk_idx.device)] = True
        keep = kept[topk_idx]  # [T, k]
        if bool(keep.all()):
            return topk_idx, topk_w  # every routed expert is kept: exactly the unbudgeted pass
        if self.mode == "truncate":
            w = topk_w * keep  # [T, k]
            total, kept_sum = topk_w.sum(-1, keepdim=True), w.sum(-1, keepdim=True)  # [T, 1]
            scale = torch.where(kept_sum > 0, total / kept_sum.clamp_min(torch.finfo(w.dtype).tiny), 0.0)
            return torch.where(keep, topk_idx, E), w * scale
        return self._substitute(topk_idx, topk_w, keep, ranked.tolist())

    def _substitute(self, topk_idx, topk_w, keep, ranked: list[int]):
        E = self.num_experts
        idx, w = topk_idx.tolist(), topk_w.clone()
        for t, (row, row_keep) in enumerate(zip(idx, keep.tolist())):
            free = iter([e for e in ranked if e not in {x for x, k in zip(row, row_keep) if k}])
            for j, k in enumerate(row_keep):
                if not k:
                    row[j] = next(free, E)
                    if row[j] == E:
                        w[t, j] = 0
        return torch.tensor(idx, dtype=topk_idx.dtype, device=topk_idx.device), w


class MoESpec(Specter):
    """Specter with MoE-Spec's verification-time expert budget."""

    name = "moe_spec"

    def residency(self) -> str:
        return "lru"  # the design's cache; the window-aware policy is Specter's

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        m, E = cfg.method, int(cfg.model.num_experts)
        B = E // 2 if m.budget is None else m.budget
        if not isinstance(B, int) or not 1 <= B <= E:
            raise ConfigError(f"method.budget must be an integer in 1..{E} (the routed experts), got {B!r}")
        if m.budget_mode not in BUDGET_MODES:
            raise ConfigError(f"unknown method.budget_mode {m.budget_mode!r}; choose one of {list(BUDGET_MODES)}")
        if (cfg.method.get("decode_path") or "hf") != "hf":
            raise ConfigError("moe_spec reads every router's logits through a forward hook on transformers' router "
                              "modules, which the compact decode path fuses away: use method.decode_path=hf")
        if cfg.verify_lossless:
            raise ConfigError("moe_spec is lossy by design: verify_lossless does not apply (its records carry "
                              "first_divergence, token_match_fraction and target_nll instead)")
        self.budget = ExpertBudget(B, m.budget_mode, E)
        super().__init__(cfg, checkpoint)
        self.budget.watch(self.rt.model)
        self._references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def expert_filter(self) -> ExpertBudget:
        return self.budget

    def make_spec(self, cfg: DictConfig) -> MethodSpec:
        """Specter's spec; a verification computes at most B experts per layer, so the plan keeps no more."""
        return replace(super().make_spec(cfg), plan_cap=self.budget.budget)

    def generate(self, prompt_ids, max_new_tokens, generator):
        gen = super().generate(prompt_ids, max_new_tokens, generator)  # the clock stops at the last commit
        gen.stats.update(self.quality(prompt_ids, gen.tokens))
        return gen

    @torch.inference_mode()
    def quality(self, prompt_ids: torch.Tensor, tokens: list[int]) -> dict[str, Any]:
        """Target NLL of `tokens` and agreement with target-only greedy decoding (host experts, untimed)."""
        P, n = prompt_ids.shape[1], len(tokens)
        with self.rt.moe.mode("target", host_compute=True):  # full router, experts from the host store
            ids = torch.cat([prompt_ids[0], torch.tensor(tokens[:-1], dtype=prompt_ids.dtype, device=prompt_ids.device)])
            logits = self.rt.model(input_ids=ids[None]).logits[0, P - 1:].float()  # [n, V]
            target = torch.tensor(tokens, device=logits.device)
            nll = -F.log_softmax(logits, dim=-1).gather(1, target[:, None]).mean()
            stats: dict[str, Any] = {"target_nll": float(nll)}
            if self.params.greedy:
                key = (tuple(prompt_ids[0].tolist()), n)
                if key not in self._references:
                    self._references[key] = generate_autoregressive(self.rt.model, prompt_ids, n, self.params)
                ref = self._references[key]
                same = [a == b for a, b in zip(tokens, ref)]
                stats["first_divergence"] = same.index(False) if False in same else n  # n: no divergence
                stats["token_match_fraction"] = sum(same) / n
        return stats

    def static_fields(self) -> dict[str, Any]:
        return {**super().static_fields(), "expert_budget": self.budget.budget, "budget_mode": self.budget.mode}

    def environment(self) -> dict[str, Any]:
        return {**super().environment(), "expert_budget": self.budget.budget, "budget_mode": self.budget.mode}
