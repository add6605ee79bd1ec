"""Transformers + accelerate, the way a user offloads a model that does not fit: `method=transformers`.

The target checkpoint is loaded with `AutoModelForCausalLM.from_pretrained` and decoded with
`model.generate`. On CUDA, `device_map="auto"` with `max_memory` set to the memory tier's budget
places what fits on the GPU and leaves the rest (whole decoder layers) in host memory, where
accelerate's hooks move each module's weights to the GPU when its forward runs: the coarse
on-demand offload of the paper's comparison. On a CPU-only machine the model runs on the CPU.

Timing follows the harness's commit clock exactly: a streamer stamps each token as `generate` hands
it over, so TPOT is (last stamp − first stamp) / (N − 1), as for Specter's own methods. EOS never
stops a record (`eos_token_id=None`), and greedy decoding is plain argmax, so at temperature 0 the
tokens equal `method=target_only`'s. Sampling uses transformers' own sampler, seeded per record.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from baselines.common import (
    ExternalEngine,
    PeakMemory,
    ReferenceTokens,
    agreement,
    checkpoint_bytes,
    reference_check_enabled,
    seed_of,
)
from specter.assembly.methods import Generation
from specter.assembly.sizing import budget_bytes
from specter.metrics import CommitClock

if TYPE_CHECKING:
    from specter.assembly.plan import MemoryPlan


class CommitStreamer:
    """A `generate` streamer that stamps each step's new token on every request's commit clock.

    `generate` hands the streamer the prompt first, then one token per sequence per step.
    """

    def __init__(self, clocks: CommitClock | list[CommitClock]):
        self.clocks = clocks if isinstance(clocks, list) else [clocks]
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for clock in self.clocks:  # value: [B] (or [1, 1] for one sequence): one token each
            clock.commit(1)

    def end(self) -> None:
        pass


class TransformersEngine(ExternalEngine):
    """The checkpoint through transformers' `generate`, offloaded by accelerate on CUDA."""

    name = "transformers"

    @classmethod
    def plan_rows(cls, p: MemoryPlan, name: str) -> None:
        """The memory plan's row: accelerate's device_map=auto keeps what the tier's budget holds on the device."""
        on_dev = min(p.f.full_bytes, p.budget)
        p.add_engine(name, on_dev, 0, f"device_map=auto, max_memory={p.budget / 1e9:.2f} GB; "
                                      f"{(p.f.full_bytes - on_dev) / 1e9:.2f} GB on the host")

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if cfg.method.get("experts_implementation"):
            kwargs["experts_implementation"] = cfg.method.experts_implementation
        self.budget: int | None = None
        if self.device.type == "cuda":
            self.budget = budget_bytes(cfg, checkpoint_bytes(checkpoint, self.dtype))
            gpu = self.device.index if self.device.index is not None else torch.cuda.current_device()
            kwargs.update(device_map="auto", max_memory={gpu: self.budget, "cpu": _host_bytes()})
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).to(self.device).eval()
        self.peak = PeakMemory(self.device)
        self.reference = ReferenceTokens(cfg, checkpoint) if reference_check_enabled(cfg, self.device) else None

    def generate(self, prompt_ids, max_new_tokens, generator):
        clock = CommitClock()
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": None, "use_cache": True,
                                  "pad_token_id": self.model.config.pad_token_id, "streamer": CommitStreamer(clock)}
        if self.params.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=self.params.temperature, top_p=self.params.top_p,
                          top_k=self.params.top_k)
            torch.manual_seed(seed_of(generator))  # transformers samples from torch's global generator
        ids = prompt_ids.to(self.device)  # [1, P]; accelerate's hooks run offloaded modules on this device too
        self.peak.reset()
        clock.start()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # [1, P + N]
        stats: dict[str, Any] = {"peak_memory_bytes": self.peak.read()}
        tokens = out[0, ids.shape[1]:].tolist()
        if len(tokens) != max_new_tokens:
            raise RuntimeError(f"transformers generated {len(tokens)} tokens, not {max_new_tokens}")
        if self.reference is not None and self.params.greedy:
            stats.update(agreement(tokens, self.reference(prompt_ids[0].tolist(), len(tokens))))
        return Generation(tokens, clock, stats)

    def generate_batch(self, prompts, max_new_tokens, generators):
        """The prompts as one left-padded batch through `generate` (experiment=batch); each request's clock
        is stamped at every step. Sampling draws from torch's global generator, seeded by the first request."""
        from specter.speculative.batch_state import Request
        from specter.speculative.batched import BatchRun

        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        width = max(int(p.numel()) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, P_max], left-padded
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - p.numel():], mask[b, width - p.numel():] = p.cpu(), 1
        requests = [Request(rid=b, prompt_len=int(p.numel()), max_new_tokens=max_new_tokens, prompt=p.tolist())
                    for b, p in enumerate(prompts)]
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": None, "use_cache": True,
                                  "pad_token_id": pad, "streamer": CommitStreamer([r.clock for r in requests])}
        if self.params.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=self.params.temperature, top_p=self.params.top_p,
                          top_k=self.params.top_k)
            torch.manual_seed(seed_of(generators[0]))
        self.peak.reset()
        for r in requests:
            r.clock.start()
        with torch.inference_mode():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)  # [B, P_max + N]
        peak = self.peak.read()
        for b, r in enumerate(requests):
            r.tokens = out[b, width:].tolist()
            r.stats["peak_memory_bytes"] = peak
            if self.reference is not None and self.params.greedy:
                r.stats.update(agreement(r.tokens, self.reference(r.prompt, len(r.tokens))))
        return BatchRun(requests, {"iterations": max_new_tokens})

    def environment(self) -> dict[str, Any]:
        import accelerate
        import transformers

        env: dict[str, Any] = {"engine": "transformers", "transformers": transformers.__version__,
                               "accelerate": accelerate.__version__,
                               "experts_implementation": getattr(self.model.config, "_experts_implementation", None),
                               "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}
        device_map = getattr(self.model, "hf_device_map", None)
        if device_map:
            on_host = sorted(k for k, v in device_map.items() if str(v) in ("cpu", "disk"))
            env.update(budget_bytes=self.budget, modules_on_device=len(device_map) - len(on_host),
                       modules_offloaded=len(on_host), offloaded=on_host)
        return env

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()


def _host_bytes() -> int:
    """Host memory accelerate may use for offloaded weights (what the machine has)."""
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
