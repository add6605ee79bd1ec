"""llama.cpp through llama-cpp-python, over a GGUF export of the same weights: `method=llamacpp`.

The checkpoint is exported once to GGUF (baselines/gguf_export.py, cached by weights digest) in F32
for float32 runs, so llama.cpp computes with the same numbers as `method=target_only`, or F16 on
half-precision devices. Placement is llama.cpp's own: the last `n_gpu_layers` decoder layers (and
the output layer, once every layer fits) on the GPU, the rest on the CPU. On CUDA that number comes
from the memory tier's budget: layers are counted from the last one while their weights plus their
share of the KV cache fit (`gpu_layers_for_budget`); on a CPU machine everything runs on the CPU.

Each record decodes through `Llama.generate` from an empty KV cache (no prompt-prefix reuse across
records): the prompt's token ids go in, each sampled token comes out and is stamped on the commit
clock as it is yielded. EOS never stops a record; greedy decoding is llama.cpp's greedy sampler.
The KV cache has the weights' type (F32 KV for an F32 export) and flash attention is off, so numerics
follow the GGUF's type.

Where llama.cpp computes another function than transformers (`gguf_export.not_comparable_reason`:
PhiMoE's softmax top-2 routing instead of sparsemixer; Qwen2-MoE with norm_topk_prob, which llama.cpp's
qwen2moe never renormalises) the tokens are not comparable and records say so, with the reason in
env.json; compare speed. A GGUF llama.cpp refuses is one error line quoting llama.cpp's own message.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from baselines.common import (
    ExternalEngine,
    EngineUnavailable,
    PeakMemory,
    ReferenceTokens,
    agreement,
    reference_check_enabled,
    seed_of,
)
from baselines.gguf_export import GGUF_TYPES, cached_gguf, iter_layers, not_comparable_reason, tensor_bytes
from specter.assembly.config import ConfigError
from specter.assembly.methods import Generation
from specter.assembly.sizing import budget_bytes
from specter.models.facts import read_config
from specter.metrics import CommitClock

if TYPE_CHECKING:
    from specter.assembly.plan import MemoryPlan

INSTALL = 'CMAKE_ARGS="-DLLAVA_BUILD=OFF" pip install -c constraints.txt -e ".[llamacpp]"'
INSTALL_CUDA = ('CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF" pip install -c constraints.txt --no-binary '
                'llama-cpp-python -e ".[llamacpp]"')


class EngineLoadError(ConfigError):
    """llama.cpp refused the GGUF file; the message quotes what llama.cpp said."""


def load_llama(llama_cpp, model_path: Path, verbose: bool = False, **kwargs: Any):
    """`llama_cpp.Llama(model_path, ...)`, or an EngineLoadError quoting llama.cpp's own error line.

    llama-cpp-python only raises "Failed to load model from file"; llama.cpp's reason goes to its log,
    so the log is collected while the model loads (and shown as it comes when `verbose`)."""
    said: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        said.append(line)
        if verbose:
            import sys

            print(line, end="", file=sys.stderr, flush=True)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        return llama_cpp.Llama(model_path=str(model_path), verbose=verbose, **kwargs)
    except ValueError as err:
        raise EngineLoadError(f"llama.cpp cannot load {Path(model_path).resolve()}: {llama_error(''.join(said), err)}") \
            from None
    finally:
        from llama_cpp import _logger  # llama-cpp-python's own log handler again

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def llama_error(log: str, err: BaseException) -> str:
    """The line of llama.cpp's log that says why loading failed, without its function-name prefix."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for marker in ("error loading model", "error", "failed"):
        hits = [line for line in lines if marker in line.lower()]
        if hits:
            line = hits[0]
            head, sep, rest = line.partition(": ")
            return rest if sep and " " not in head else line
    return str(err)



def gpu_layers_for_budget(layer_bytes: list[int], output_bytes: int, kv_bytes_per_layer: int, budget: int) -> int:
    """How many layers llama.cpp may put on the GPU within `budget` bytes.

    llama.cpp offloads the *last* n layers; n = len(layer_bytes) + 1 also offloads the output layer.
    Each offloaded layer costs its weights and its KV cache.
    """
    used, n = 0, 0
    for b in reversed(layer_bytes):
        if used + b + kv_bytes_per_layer > budget:
            return n
        used, n = used + b + kv_bytes_per_layer, n + 1
    return n + 1 if used + output_bytes <= budget else n


def kv_bytes_per_token_layer(config: dict[str, Any], itemsize: int) -> int:
    """llama.cpp's KV bytes per token and layer (DeepSeek-V2: the compressed MLA latent and rope key)."""
    if config["model_type"] == "deepseek_v2":
        return (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])) * itemsize
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * int(config["num_key_value_heads"]) * head_dim * itemsize


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise EngineUnavailable(f"method=llamacpp needs llama-cpp-python (builds llama.cpp from source): {INSTALL}") from None
    return llama_cpp


class LlamaCpp(ExternalEngine):
    """llama.cpp decoding of the GGUF export, N layers on the GPU and the rest on the CPU."""

    name = "llamacpp"

    @classmethod
    def plan_rows(cls, p: MemoryPlan, name: str) -> None:
        """The memory plan's row: the last layers (and their KV for the run's context) that the budget holds."""
        f = p.f
        kv_layer = kv_bytes_per_token_layer(p.config.to_dict(), torch.finfo(p.dtype).bits // 8) * p.context()
        n_gpu = gpu_layers_for_budget(list(f.layer_bytes), f.head_bytes, kv_layer, p.budget)
        kept = list(f.layer_bytes)[len(f.layer_bytes) - min(n_gpu, len(f.layer_bytes)):]
        dev = sum(kept) + kv_layer * len(kept) + (f.head_bytes if n_gpu > len(f.layer_bytes) else 0)
        p.add_engine(name, dev, kv_layer * len(kept), f"n_gpu_layers={n_gpu} of {len(f.layer_bytes)} (+1 = output layer)")

    def __init__(self, cfg: DictConfig, checkpoint: Path):
        super().__init__(cfg, checkpoint)
        llama_cpp = _import_llama_cpp()
        m = cfg.method
        self.gguf_type = m.get("gguf_type") or ("f32" if self.dtype == torch.float32 else "f16")
        if self.gguf_type not in GGUF_TYPES:
            raise ConfigError(f"method.gguf_type must be one of {list(GGUF_TYPES)} (or null), got {self.gguf_type!r}")
        self.config = read_config(checkpoint).to_dict()  # with transformers' defaults, as the model is built
        self.not_comparable = not_comparable_reason(checkpoint)
        self.comparable = self.not_comparable is None
        self.gguf = cached_gguf(checkpoint, self.gguf_type, label=cfg.model.name)
        itemsize = 4 if self.gguf_type == "f32" else 2
        n_ctx = cfg.prefix_tokens + max(cfg.max_new_tokens, cfg.warmup_tokens) + 1
        self.budget: int | None = None
        device_used = None
        if self.device.type == "cuda":
            if not llama_cpp.llama_supports_gpu_offload():
                raise EngineUnavailable(f"this llama-cpp-python was built without GPU support; rebuild it: {INSTALL_CUDA}")
            self.n_gpu_layers = m.get("n_gpu_layers")
            if self.n_gpu_layers is None:
                sizes = tensor_bytes(self.gguf)
                layers = [b for _, b in iter_layers(sizes)]
                head = sum(b for name, b in sizes.items() if name.startswith(("output.", "output_norm.")))
                self.budget = budget_bytes(cfg, sum(sizes.values()))
                kv = kv_bytes_per_token_layer(self.config, itemsize) * n_ctx
                self.n_gpu_layers = gpu_layers_for_budget(layers, head, kv, self.budget)
            free_before = torch.cuda.mem_get_info(self.device)[0]

            def device_used() -> int:  # what llama.cpp took of the device since it loaded
                return free_before - torch.cuda.mem_get_info(self.device)[0]
        else:
            self.n_gpu_layers = 0
        threads = m.get("n_threads") or cfg.hardware.get("threads")
        kv_type = llama_cpp.GGML_TYPE_F32 if self.gguf_type == "f32" else llama_cpp.GGML_TYPE_F16
        self.llm = load_llama(
            llama_cpp, self.gguf, verbose=bool(cfg.get("verbose", False)), n_gpu_layers=int(self.n_gpu_layers),
            n_ctx=n_ctx, n_batch=int(m.n_batch), n_threads=threads, n_threads_batch=threads, type_k=kv_type,
            type_v=kv_type, flash_attn=False, seed=int(cfg.seed),
        )
        self.version = llama_cpp.__version__
        self.peak = PeakMemory(self.device, device_used)
        self.reference = (ReferenceTokens(cfg, checkpoint)
                          if self.comparable and reference_check_enabled(cfg, self.device) else None)

    def reset(self) -> None:
        self.llm.reset()  # an empty KV cache: the next prompt is evaluated in full, never reused

    def generate(self, prompt_ids, max_new_tokens, generator):
        p = self.params
        prompt = prompt_ids[0].tolist()
        self.llm.reset()
        self.llm.set_seed(seed_of(generator))
        sampling = {"temp": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": 0.0, "typical_p": 1.0,
                    "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
        clock = CommitClock()
        tokens: list[int] = []
        self.peak.reset()
        clock.start()
        stream = self.llm.generate(prompt, reset=True, **sampling)
        try:
            for token in stream:  # llama.cpp evaluates, samples and yields one token at a time; no EOS stop
                tokens.append(int(token))
                clock.commit(1)
                if len(tokens) == max_new_tokens:
                    break
        finally:
            stream.close()
        stats: dict[str, Any] = {"peak_memory_bytes": self.peak.read()}
        if not self.comparable:
            stats["lossless_check"] = "not comparable"
        elif self.reference is not None and p.greedy:
            stats.update(agreement(tokens, self.reference(prompt, len(tokens))))
        return Generation(tokens, clock, stats)

    def environment(self) -> dict[str, Any]:
        env: dict[str, Any] = {"engine": "llama.cpp", "llama_cpp_python": self.version, "gguf": str(self.gguf),
                               "gguf_type": self.gguf_type, "n_gpu_layers": self.n_gpu_layers,
                               "n_layers": int(self.config["num_hidden_layers"]), "budget_bytes": self.budget,
                               "tokens_comparable": self.comparable}
        if not self.comparable:
            env["tokens_not_comparable_because"] = self.not_comparable
        return env

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()

