"""What the engine baselines (transformers, llama.cpp, vLLM) share: peak memory, reference tokens, errors.

Each engine runs the harness protocol unchanged; these helpers add what the paper's comparison needs
around the engine: the record's peak memory (the process's peak RSS on a CPU, the device's peak on
CUDA), and at temperature 0 the agreement of the engine's tokens with target-only decoding of the
same prompt, computed after the timed generation (`first_divergence`, `token_match_fraction`,
`lossless_check`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from specter.harness.config import ConfigError
from specter.harness.runtime import device_and_dtype
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams


class EngineUnavailable(ConfigError):
    """An engine's package or environment is missing; the message names the command that installs it."""


def process_peak_rss_reset() -> None:
    """Reset this process's peak-RSS mark (Linux: VmHWM restarts from the current RSS)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not permitted: the mark then covers the process's lifetime
        pass


def process_peak_rss() -> int | None:
    """Peak resident set size of this process in bytes since the last reset (None where unknown)."""
    try:
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


class PeakMemory:
    """Per-record peak memory of an engine running in this process.

    CPU: the process's peak RSS. CUDA: `torch.cuda.max_memory_allocated` for engines that allocate
    through torch, or `device_used`, a callable giving the engine's device bytes (engines with
    their own allocator: their buffers are allocated up front, so what they hold after a record is
    their peak).
    """

    def __init__(self, device: torch.device, device_used: Callable[[], int] | None = None):
        self.device, self.device_used = device, device_used

    def reset(self) -> None:
        if self.device.type == "cuda" and self.device_used is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type != "cuda":
            process_peak_rss_reset()

    def read(self) -> int | None:
        if self.device.type == "cuda":
            if self.device_used is not None:
                return int(self.device_used())
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return process_peak_rss()


def agreement(tokens: list[int], reference: list[int]) -> dict[str, Any]:
    """Record columns comparing an engine's greedy tokens with target-only decoding.

    first_divergence: index of the first differing token (len(tokens) when none differs);
    lossless_check: "exact" or "diverged@i".
    """
    n = len(tokens)
    same = [a == b for a, b in zip(tokens, reference)] + [False] * (n - min(n, len(reference)))
    first = same.index(False) if False in same else n
    return {"first_divergence": first, "token_match_fraction": sum(same) / n if n else None,
            "lossless_check": "exact" if first == n else f"diverged@{first}"}


class ReferenceTokens:
    """Greedy target-only tokens of a prompt (the plain transformers model, as `method=target_only` runs it).

    The reference model lives in a separate process, started on first use and kept for the run, so
    its memory never counts in the engine's peak RSS; each (prompt, length) is decoded once, after
    the timed generation, so it never affects an engine's timing either.
    """

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        device, dtype = device_and_dtype(cfg)
        self.initargs = (str(checkpoint), str(dtype).removeprefix("torch."), str(device), cfg.hardware.get("threads"))
        self.pool = None
        self.memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt_ids: list[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in self.memo:
            if self.pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_reference_init, initargs=self.initargs)
            self.memo[key] = self.pool.submit(_reference_decode, list(prompt_ids), n).result()
        return self.memo[key]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


_REFERENCE: dict[str, Any] = {}  # the reference process's model and device


def _reference_init(checkpoint: str, dtype: str, device: str, threads: int | None) -> None:
    from specter.models.loading import DTYPES, load_full_model

    torch.set_num_threads(int(threads or 1))
    _REFERENCE["device"] = torch.device(device)
    _REFERENCE["model"] = load_full_model(Path(checkpoint), DTYPES[dtype], _REFERENCE["device"])


def _reference_decode(prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=_REFERENCE["device"])  # [1, P]
    return generate_autoregressive(_REFERENCE["model"], ids, n, SamplingParams())


def reference_check_enabled(cfg: DictConfig, device: torch.device) -> bool:
    """`method.reference_check`, where null means on for CPU runs and off on CUDA.

    On CUDA the full target model would share the device with the engine under test and distort its
    memory figures; set `method.reference_check=true` to compare there anyway.
    """
    value = cfg.method.get("reference_check")
    return device.type != "cuda" if value is None else bool(value)


def seed_of(generator: torch.Generator | None) -> int:
    """An integer seed for an engine with its own sampler, from the record's torch generator."""
    return int(generator.initial_seed()) % 2**31 if generator is not None else 0


def checkpoint_bytes(checkpoint: Path, dtype: torch.dtype) -> int:
    """Bytes of every tensor of a checkpoint held in `dtype` (from the safetensors headers; nothing loads)."""
    from safetensors import safe_open

    itemsize = torch.finfo(dtype).bits // 8
    total = 0
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= int(d)
                total += n * itemsize
    return total
