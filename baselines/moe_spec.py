"""MoE-Spec (McDanel et al., 2026) verification-time expert budgeting on Specter: `method=moe_spec`.

Specter's speculative engine unchanged, except in each verification pass: per MoE layer, rank the
experts by routing weight summed over the pass's tokens and keep the top B (`method.budget`); a
route to a dropped expert is

    truncate    removed, and the token's kept weights rescaled to its original total weight
    substitute  sent to the best-ranked kept expert the token does not already use, same weight
                (removed when the token already uses every kept expert)

Fewer distinct experts per window means fewer loads, at the cost of acceptance and of output
quality: the method is lossy and is not held to token equality. Its records carry, computed after
generation and outside timing, `first_divergence` and `token_match_fraction` against target-only
greedy decoding of the same prompt, and `target_nll`, the target's mean negative log-likelihood of
the generated tokens. With B at least the distinct experts of every pass nothing is dropped and the
method is Specter exactly. The prefill is not a verification and runs the full router.

Ranking uses the weights the router hands to the experts (its top-k probabilities; Phi's
sparsemixer multipliers), i.e. each expert's routing probability summed over the tokens that
select it: an expert no token selects is never kept, so the budget is never spent on one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from specter.harness.config import ConfigError
from specter.harness.methods import Specter
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.engine import SpeculativeEngine
from specter.speculative.state import SequenceState

BUDGET_MODES = ("truncate", "substitute")


class ExpertBudget:
    """The `expert_filter` of a verification pass: keep each layer's top-B experts by routing weight."""

    def __init__(self, budget: int, mode: str, num_experts: int):
        if mode not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {mode!r}; choose one of {BUDGET_MODES}")
        self.budget, self.mode, self.num_experts = budget, mode, num_experts
        self.active = True  # off during the prefill (set by BudgetedEngine)

    def __call__(self, layer: int, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        E, B = self.num_experts, self.budget
        if not self.active:
            return topk_idx, topk_w
        score = torch.zeros(E + 1, dtype=torch.float32, device=topk_w.device)  # [E+1]; E = "no expert"
        score.index_add_(0, topk_idx.reshape(-1), topk_w.reshape(-1).float())
        used = torch.zeros(E + 1, dtype=torch.bool, device=topk_idx.device).index_fill_(0, topk_idx.reshape(-1), True)
        used[E] = False
        if int(used.sum()) <= B:
            return topk_idx, topk_w  # nothing to drop: exactly the unbudgeted pass
        score = torch.where(used, score, torch.full_like(score, -1.0))
        ranked = torch.sort(score[:E], descending=True, stable=True).indices[:B]  # [B], ties -> lower id
        kept = torch.zeros(E + 1, dtype=torch.bool, device=topk_idx.device)
        kept[ranked] = True
        keep = kept[topk_idx]  # [T, k]
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


class BudgetedEngine(SpeculativeEngine):
    """Specter's engine; the budget applies to target passes after the prefill (the verifications)."""

    def _target(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        self.expert_filter.active = state.committed_kv > 0
        return super()._target(ids, state)


class MoESpec(Specter):
    """Specter with MoE-Spec's verification-time expert budget."""

    name = "moe_spec"
    engine_class = BudgetedEngine

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        m, E = cfg.method, int(cfg.model.num_experts)
        B = E // 2 if m.budget is None else m.budget
        if not isinstance(B, int) or not 1 <= B <= E:
            raise ConfigError(f"method.budget must be an integer in 1..{E} (the routed experts), got {B!r}")
        if m.budget_mode not in BUDGET_MODES:
            raise ConfigError(f"unknown method.budget_mode {m.budget_mode!r}; choose one of {list(BUDGET_MODES)}")
        if cfg.verify_lossless:
            raise ConfigError("moe_spec is lossy by design: verify_lossless does not apply (its records carry "
                              "first_divergence, token_match_fraction and target_nll instead)")
        self.budget = ExpertBudget(B, m.budget_mode, E)
        super().__init__(cfg, checkpoint)
        # A verification uses at most B experts per layer: the planner predicts no more than that.
        self.engine.capacity = {layer: min(c, B) for layer, c in self.engine.capacity.items()}
        self._references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def expert_filter(self) -> ExpertBudget:
        return self.budget

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
