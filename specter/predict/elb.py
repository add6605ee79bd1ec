"""Expert Load Buffer (ELB): per-layer activation counters of the draft router, kept on the device.

After t draft tokens the counter of expert e in MoE layer j is

    ELB_cnt[j, e] = sum_{i < t} [e in ELB_route[i, j]]

where ELB_route[i, j] is the top-k set the draft router chose for token i in layer j. Only the
counters ``[L, E]`` (int32) exist; routes are folded in with ``index_add_`` on the device, so
drafting never waits on the host. At a prefetch checkpoint the per-layer top-M ranking is
computed on the device and crosses to the host as one copy of one ``[L, M_max]`` tensor.
The buffer is cleared at the end of every draft window.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


class ExpertLoadBuffer:
    """Draft-routing counters ``[L, E]`` for the MoE layers ``moe_layers`` (model layer ids)."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, device: torch.device | str = "cpu"):
        layers = [int(layer) for layer in moe_layers]
        if len(set(layers)) != len(layers):
            raise ValueError(f"duplicate MoE layer ids: {layers}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.moe_layers = layers
        self.num_experts = num_experts
        self.device = torch.device(device)
        self._row = {layer: i for i, layer in enumerate(layers)}
        self._cnt = torch.zeros(len(layers), num_experts, dtype=torch.int32, device=self.device)  # [L, E]
        self._ones = torch.ones(0, dtype=torch.int32, device=self.device)  # reused increments

    def add(self, layer_id: int, topk_idx: torch.Tensor) -> None:
        """Count the routes ``topk_idx [T, k]`` of one MoE layer (no host synchronisation)."""
        flat = topk_idx.reshape(-1).to(device=self.device, dtype=torch.long)  # [T*k]
        n = flat.numel()
        if n > self._ones.numel():
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int32, device=self.device)
        self._cnt[self._row[layer_id]].index_add_(0, flat, self._ones[:n])

    def snapshot_plan(self, capacity: Mapping[int, int]) -> dict[int, list[int]]:
        """Per layer of ``capacity`` (layer -> M): its top-M experts, most counted first.

        Only experts counted at least once qualify; equal counts go to the lower expert id.
        The ranking is computed on the device and read back in a single copy.
        """
        for layer, m in capacity.items():
            if layer not in self._row:
                raise KeyError(f"layer {layer} is not an MoE layer of this buffer")
            if m < 0:
                raise ValueError(f"capacity of layer {layer} must be >= 0, got {m}")
        m_max = min(max(capacity.values(), default=0), self.num_experts)
        if m_max == 0:
            return {layer: [] for layer in capacity}
        # Stable descending sort: ties keep ascending expert-id order.
        order = torch.sort(self._cnt, dim=1, descending=True, stable=True).indices[:, :m_max]  # [L, M_max]
        counted = self._cnt.gather(1, order) > 0  # [L, M_max]
        ranked = torch.where(counted, order, torch.full_like(order, -1)).to(torch.int32)  # [L, M_max], -1 = none
        rows = ranked.cpu().tolist()  # the one D2H copy of the checkpoint
        plan: dict[int, list[int]] = {}
        for layer, m in capacity.items():
            row = rows[self._row[layer]][:m]
            plan[layer] = [e for e in row if e >= 0]  # counted experts form a prefix of the row
        return plan

    def counts(self) -> torch.Tensor:
        """The counters ``[L, E]`` (int32, rows in ``moe_layers`` order) as a CPU copy (a D2H copy: for
        inspection and records, not the draft loop)."""
        return self._cnt.cpu().clone()

    def clear(self) -> None:
        """Drop all routing evidence (end of a draft window)."""
        self._cnt.zero_()

