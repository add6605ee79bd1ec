"""The emulated link's load ratio, from the same cost model the projection uses.

One model of the paper's machine for both views: a CPU run with `hardware=emulated` charges one
expert load `r` x one measured layer step of the tiny model, and the projection charges one expert
load `h2d()` seconds on the modelled device. Both say the same thing when

    r = h2d(one FP16 expert) / ((draft_step() - lm_head) / num_layers)

on the real model the tiny one stands for (`model.real`), on the device file the run names
(`hardware.device_model`, the paper's A100 by default). `model.load_ratio=<r>` overrides it; the
earlier hand estimates (0.7 for DeepSeek-V2-Lite and Qwen1.5-MoE, 6 for Phi-3.5-MoE) are kept as
the named point `LEGACY_ESTIMATE` of the load-ratio sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

DEFAULT_DEVICE = "a100_40gb_pcie4"
# The ratios the emulated link used before it was tied to the cost model (a hand estimate, per real model).
LEGACY_ESTIMATE = {"dsv2": 0.7, "qwen15moe": 0.7, "phi35moe": 6.0}


@dataclass(frozen=True)
class LinkRatio:
    """One expert's H2D over one draft layer step of `real` on `device`."""

    real: str
    device: str
    h2d_ms: float  # one FP16 routed expert, host -> device
    draft_layer_ms: float  # one draft token's step through the decoder layers (no lm_head), over the layer count
    num_layers: int

    @property
    def ratio(self) -> float:
        return self.h2d_ms / self.draft_layer_ms

    @property
    def source(self) -> str:
        return (f"cost model: {self.real} on {self.device} (one expert H2D {self.h2d_ms:.3f} ms / one draft layer "
                f"{self.draft_layer_ms:.4f} ms = the draft step's {self.num_layers} decoder layers, lm_head left out)")


@lru_cache(maxsize=None)
def link_ratio(real: str, device: str = DEFAULT_DEVICE) -> LinkRatio:
    """The load ratio of `real` (dsv2 | qwen15moe | phi35moe) on a device file (name or path)."""
    from specter.projection.cost_model import cost_model

    cm = cost_model(real, device)
    L = cm.s.num_layers
    layers_only = cm.draft_step() - cm.t(cm.lm_head(1))  # a layer step is the layers' work, not the vocabulary's
    return LinkRatio(real, cm.d.name, cm.h2d() * 1e3, layers_only * 1e3 / L, L)
