"""What the engine baselines (transformers, llama.cpp, vLLM) share: peak memory, reference tokens, errors.

Each engine runs the harness protocol unchanged; these helpers add what the paper's comparison needs
around the engine: the record's peak memory (the process's peak RSS on a CPU, the device's peak on
CUDA), and at temperature 0 the agreement of the engine's tokens with target-only decoding of the
same prompt, computed after the timed generation (`first_divergence`, `token_match_fraction`,
`lossless_check`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specter.assembly.config import ConfigError
from specter.assembly.methods import Method
from specter.assembly.runtime import device_and_dtype
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

    The reference model lives in a separate process (`python -m baselines.common`, JSON lines over
    its pipes), started on first use and kept for the run, so its memory never counts in the
    engine's peak RSS; each (prompt, length) is decoded once, after the timed generation, so it never
    affects an engine's timing either.
    """

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        device, dtype = device_and_dtype(cfg)
        threads = cfg.hardware.get("threads")
        self.args = [str(checkpoint), str(dtype).removeprefix("torch."), str(device), str(threads or 1)]
        self.proc: subprocess.Popen | None = None
        self.memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt_ids: list[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in self.memo:
            if self.proc is None:
                root = str(Path(__file__).resolve().parents[1])
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
                self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
                self.proc = subprocess.Popen([sys.executable, "-m", "baselines.common", *self.args], cwd=root, env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
            self.proc.stdin.write(json.dumps({"prompt": list(prompt_ids), "n": n}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                tail = "\n".join(self.log.read().splitlines()[-10:])
                raise RuntimeError(f"the target-only reference process exited (status {self.proc.wait()}):\n{tail}")
            self.memo[key] = json.loads(line)["tokens"]
        return self.memo[key]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
            self.proc = None


def _reference_server(checkpoint: str, dtype: str, device: str, threads: str) -> None:
    """The reference process: load the target once, answer {"prompt", "n"} lines with {"tokens"}."""
    from specter.models.loading import DTYPES, load_full_model

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library output goes to stderr, never into the replies
    sys.stdout = sys.stderr
    torch.set_num_threads(int(threads))
    dev = torch.device(device)
    model = load_full_model(Path(checkpoint), DTYPES[dtype], dev)
    for line in sys.stdin:
        msg = json.loads(line)
        ids = torch.tensor([msg["prompt"]], device=dev)  # [1, P]
        replies.write(json.dumps({"tokens": generate_autoregressive(model, ids, int(msg["n"]), SamplingParams())}) + "\n")


class ExternalEngine(Method):
    """A method whose engine places and moves the weights itself: an emulated link would not be what it measures."""

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        if cfg.hardware.get("link") == "emulated":
            raise ConfigError(f"method={cfg.method.name} runs its engine's own weight placement; hardware=emulated's "
                              f"link does not apply to it: use hardware=cpu (or hardware=cuda)")
        super().__init__(cfg, checkpoint)


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
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= int(d)
                total += n * itemsize
    return total


if __name__ == "__main__":
    _reference_server(*sys.argv[1:5])
