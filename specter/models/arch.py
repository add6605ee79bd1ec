"""Architecture adapters: where the MoE blocks are and how routed experts are named on disk.

transformers 5.x gives the three architectures one experts interface (a fused module per layer,
`experts(hidden [T,H], topk_idx [T,k], topk_w [T,k])`, with `gate_up_proj [E,2I,H]` and
`down_proj [E,H,I]`), but their checkpoints keep per-expert tensors under different names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEArch:
    model_type: str
    disk_block: str  # the MoE block's name in checkpoint keys
    router_attr: str  # the router inside the block (module name)
    parts: dict[str, str]  # Specter part ("gate" | "up" | "down") -> checkpoint linear name
    router_disk: str  # the router's name in checkpoint keys

    def expert_key_pattern(self) -> re.Pattern:
        names = "|".join(self.parts.values())
        return re.compile(rf"^model\.layers\.(\d+)\.{self.disk_block}\.experts\.(\d+)\.({names})\.weight$")

    def parse_expert_key(self, key: str) -> tuple[int, int, str] | None:
        """(layer, expert, part) for a routed-expert checkpoint key, else None."""
        m = self.expert_key_pattern().match(key)
        if not m:
            return None
        part = {v: k for k, v in self.parts.items()}[m.group(3)]
        return int(m.group(1)), int(m.group(2)), part

    def module_key(self, disk_key: str) -> str:
        """Checkpoint key -> module state-dict key for non-expert tensors."""
        if self.disk_block != "mlp":
            disk_key = disk_key.replace(f".{self.disk_block}.{self.router_disk}.", f".mlp.{self.router_attr}.")
            disk_key = disk_key.replace(f".{self.disk_block}.", ".mlp.")
        return disk_key


ARCHS: dict[str, MoEArch] = {
    "deepseek_v2": MoEArch("deepseek_v2", "mlp", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, "gate"),
    "qwen2_moe": MoEArch("qwen2_moe", "mlp", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, "gate"),
    "phimoe": MoEArch("phimoe", "block_sparse_moe", "router", {"gate": "w1", "up": "w3", "down": "w2"}, "gate"),
}


def arch_for(model_type: str) -> MoEArch:
    if model_type not in ARCHS:
        raise ValueError(f"unsupported architecture {model_type!r}; Specter supports {sorted(ARCHS)}")
    return ARCHS[model_type]


def moe_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder-layer index -> MoE block (the module owning `experts`), dense layers skipped."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


