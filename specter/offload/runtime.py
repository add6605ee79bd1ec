"""The offloading runtime one method decodes through: model, host store, link, cache, MoE mode, budget.

Assembled once per method from its spec (`specter.assembly.runtime.build_runtime`, then
`final_runtime` at the final cache size); frozen: the engine only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from specter.offload.budget import Footprint, check_budget
from specter.offload.cache import ExpertCache
from specter.offload.calibrate import LinkParams, link_for_step
from specter.offload.instruments import Instruments
from specter.offload.link import TransferLink

if TYPE_CHECKING:
    from specter.models.loading import OffloadedModel
    from specter.moe import MoERuntime


@dataclass(frozen=True)
class Runtime:
    """Everything an offloading method decodes through: model, host store, link, cache, budget."""

    om: "OffloadedModel"
    cache: ExpertCache
    link: TransferLink
    moe: "MoERuntime"
    link_params: LinkParams
    footprint: Footprint
    budget_bytes: int
    resident: int  # M: device slots per MoE layer
    weights_digest: str = ""
    decoder: Any = None  # the compact decoder over `model`'s tensors (decode_path=compact), else None
    planned: Any = None  # slots and staging from the real model's plan (assembly.real_plan.PlannedSlots), else None

    @property
    def model(self) -> torch.nn.Module:
        return self.om.model

    @property
    def forward_model(self) -> Any:
        """What single-request decoding calls: the compact decoder when there is one, else the model
        (both take `(input_ids=..., cache=...)` and return `.logits`; the batched paths use the model)."""
        return self.decoder if self.decoder is not None else self.om.model

    def close(self) -> None:
        self.link.close()

    def instrumented(self, instruments: Instruments) -> "Runtime":
        """This runtime with `instruments` installed -> the runtime to decode through: their link replaces this
        one's (closed; the cache loads through the new one) and the MoE runtime reports to their meter."""
        rt = self
        if instruments.link is not None:
            self.link.close()
            self.cache.link = instruments.link
            rt = replace(self, link=instruments.link)
        if instruments.meter is not None:
            self.moe.meter = instruments.meter
        return rt

    def recalibrate_link(self, per_layer_step_s: float, latency_us: float | None, source: str) -> "Runtime":
        """Re-time an emulated link calibrated from a ratio to a layer step measured later in the run
        (its warm-up) -> the runtime carrying the new `link_params` (what env.json records); this one
        keeps the old. The link itself is re-tuned (`TransferLink.retune`) for the copies that follow:
        it is the one both runtimes share."""
        p = self.link_params
        if p.kind != "emulated" or not p.calibrated or not p.load_ratio:
            raise ValueError("only an emulated link calibrated from model.load_ratio can be recalibrated")
        new = link_for_step(self.om.store.nbytes_per_expert, p.load_ratio, per_layer_step_s, latency_us,
                            p.calibration_file, source)
        self.link.retune(new.bandwidth_bytes_per_s, new.latency_s)
        return replace(self, link_params=new)

    def check_budget(self, what: str) -> None:
        """Refuse a footprint over the budget (closing the link)."""
        try:
            check_budget(self.footprint, self.budget_bytes, what)
        except Exception:
            self.close()
            raise

    def environment(self) -> dict[str, Any]:
        return {"link": self.link_params.as_dict(), "resident_experts_per_layer": self.resident,
                "staging_buffers": self.cache.staging, "expert_bytes": self.om.store.nbytes_per_expert,
                "moe_layers": self.om.moe_layers, "footprint_bytes": self.footprint.record(self.budget_bytes),
                "budget_bytes": self.budget_bytes, "weights_sha256": self.weights_digest,
                "slots_source": self.planned.source if self.planned is not None else "the tier's own budget"}

    def record_fields(self) -> dict[str, int]:
        """The record columns of this device layout (the same for every record of a run)."""
        fp = self.footprint
        return {"staging_buffers": self.cache.staging, "footprint_bytes": fp.total, "budget_bytes": self.budget_bytes,
                "slot_bytes": fp.cache_slots, "staging_bytes": fp.staging,
                "draft_bytes": fp.draft_experts + fp.draft_non_expert}
