"""Proxy -> real model: a tiny model's per-token routes stand for the real model's MoE layers.

Rule: the tiny model's MoE layers j = 0..Lt-1 each stand for a contiguous block of the real
model's Lr MoE layers (block j holds real layers floor(j*Lr/Lt) .. floor((j+1)*Lr/Lt)-1). Inside
a block, copy c reuses layer j's routes with expert ids passed through a permutation of
range(E_real) drawn from numpy's PCG64 seeded by (seed, j, c), so two copies of one tiny layer do
not share cache state (copy 0 of each block is the identity). When the tiny model has fewer
experts than the real one (E_t != E_r), tiny id e becomes floor(e * E_r / E_t) before the
permutation (ids spread over the real range, order kept).
"""

from __future__ import annotations

import numpy as np


def layer_blocks(tiny_layers: int, real_layers: int) -> list[list[int]]:
    """Real MoE layer indices each tiny MoE layer stands for (contiguous, covering all, none empty)."""
    if tiny_layers < 1 or real_layers < tiny_layers:
        raise ValueError(f"cannot map {tiny_layers} tiny MoE layers onto {real_layers} real ones")
    return [list(range(j * real_layers // tiny_layers, (j + 1) * real_layers // tiny_layers)) for j in range(tiny_layers)]


class RouteMap:
    """Maps (tiny layer, tiny expert ids) to {real layer: real expert ids}."""

    def __init__(self, tiny_layers: int, tiny_experts: int, real_layers: int, real_experts: int, seed: int = 0,
                 permute: bool = True):
        self.blocks = layer_blocks(tiny_layers, real_layers)
        self.tiny_experts, self.real_experts = tiny_experts, real_experts
        self.perm: dict[int, np.ndarray] = {}  # real layer -> [E_real] permutation
        for j, block in enumerate(self.blocks):
            for c, layer in enumerate(block):
                if permute and c > 0:
                    rng = np.random.Generator(np.random.PCG64([seed, j, c]))
                    self.perm[layer] = rng.permutation(real_experts)
                else:
                    self.perm[layer] = np.arange(real_experts)

    def expert_id(self, e: int) -> int:
        if not 0 <= e < self.tiny_experts:
            raise ValueError(f"tiny expert id {e} out of range [0, {self.tiny_experts})")
        return e * self.real_experts // self.tiny_experts

    def map(self, tiny_layer: int, experts: list[int]) -> dict[int, list[int]]:
        ids = [self.expert_id(e) for e in experts]
        return {layer: [int(self.perm[layer][i]) for i in ids] for layer in self.blocks[tiny_layer]}
