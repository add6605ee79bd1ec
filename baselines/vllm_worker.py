"""The vLLM side of `method=vllm`: runs inside vLLM's own environment (scripts/setup_vllm.sh).

    <vllm env>/bin/python baselines/vllm_worker.py        # started by baselines/vllm_engine.py

Speaks JSON lines on stdin/stdout (everything vLLM logs goes to stderr) and imports nothing from
Specter, whose transformers is newer than vLLM allows. Requests, one per line:

    {"op": "load", "model": DIR, "dtype": "float32", "max_model_len": N, "seed": S,
     "cpu_offload_gb": G, "gpu_memory_utilization": U, "enforce_eager": true}
        -> {"ok": true, "vllm": VERSION, "device": "cpu" | "cuda", "architecture": NAME}
    {"op": "generate", "prompt": [ids], "max_tokens": N, "temperature": T, "top_p": P, "top_k": K, "seed": S}
        -> {"ok": true, "tokens": [ids], "stamps": [s], "counts": [n], "peak_memory_bytes": B}
    {"op": "close"}

`stamps` are seconds since the request was handed to the engine, one per engine step that produced
tokens (`counts` of them); the engine core runs in this process (no extra process between the
step loop and the model), so a stamp is when the token left vLLM. End of sequence never stops a
request (`ignore_eos`). Errors answer {"ok": false, "error": "...", "unsupported": bool}; `unsupported`
marks a checkpoint vLLM cannot run at all (e.g. an MLA head size its kernels lack).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: stamps and memory are its own


def _peak_rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


class Worker:
    def __init__(self) -> None:
        self.engine = None
        self.cuda = False
        self.requests = 0

    def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        import vllm
        from vllm import EngineArgs, LLMEngine
        from vllm.platforms import current_platform

        self.cuda = current_platform.is_cuda_alike()
        _check_supported(msg["model"])
        overrides = _architecture_override(msg["model"])
        args = EngineArgs(
            model=msg["model"], skip_tokenizer_init=True, dtype=msg["dtype"], max_model_len=int(msg["max_model_len"]),
            seed=int(msg.get("seed", 0)), enforce_eager=bool(msg.get("enforce_eager", True)),
            cpu_offload_gb=float(msg.get("cpu_offload_gb", 0.0)), max_num_seqs=1,
            **({"gpu_memory_utilization": float(msg["gpu_memory_utilization"])} if self.cuda else {}),
            **({"hf_overrides": overrides} if overrides else {}),
        )
        self.engine = LLMEngine.from_engine_args(args)
        arch = (overrides or {}).get("architectures", [None])[0] or _config(msg["model"]).get("architectures", ["?"])[0]
        return {"ok": True, "vllm": vllm.__version__, "device": "cuda" if self.cuda else "cpu", "architecture": arch}

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        temperature = float(msg.get("temperature", 0.0))
        params = SamplingParams(
            max_tokens=int(msg["max_tokens"]), ignore_eos=True, temperature=temperature,
            top_p=float(msg.get("top_p", 1.0)) if temperature > 0 else 1.0,
            top_k=int(msg.get("top_k", 0)) if temperature > 0 else 0, seed=msg.get("seed"), detokenize=False,
        )
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            _peak_rss_reset()
        self.requests += 1
        request_id = f"r{self.requests}"
        tokens: list[int] = []
        stamps: list[float] = []
        counts: list[int] = []
        t0 = time.perf_counter()
        self.engine.add_request(request_id, {"prompt_token_ids": list(msg["prompt"])}, params)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id != request_id:
                    continue
                ids = list(out.outputs[0].token_ids)  # cumulative
                if len(ids) > len(tokens):
                    stamps.append(time.perf_counter() - t0)
                    counts.append(len(ids) - len(tokens))
                    tokens = ids
        if self.cuda:
            import torch

            peak = int(torch.cuda.max_memory_allocated())
        else:
            peak = _peak_rss()
        return {"ok": True, "tokens": tokens, "stamps": stamps, "counts": counts, "peak_memory_bytes": peak}


def _config(model: str) -> dict[str, Any]:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


class Unsupported(ValueError):
    """vLLM cannot run this checkpoint at all (not a numerical difference): the harness says so in one line."""


def _check_supported(model: str) -> None:
    """Refuse, before loading, what vLLM's kernels reject only at the first request."""
    config = _config(model)
    if config.get("model_type") == "deepseek_v2" and config.get("kv_lora_rank"):
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

        head = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        sizes = MLACommonBackend.get_supported_head_sizes()
        if head not in sizes:
            raise Unsupported(f"vLLM's MLA attention takes kv_lora_rank + qk_rope_head_dim in {sizes}; this "
                              f"checkpoint has {head} (DeepSeek-V2-Lite: 512 + 64 = 576)")


def _architecture_override(model: str) -> dict[str, Any] | None:
    """vLLM's spelling of the checkpoint's architecture where it differs only in case (PhimoeForCausalLM)."""
    from vllm import ModelRegistry

    arch = _config(model).get("architectures", [None])[0]
    supported = ModelRegistry.get_supported_archs()
    if arch is None or arch in supported:
        return None
    same = [a for a in supported if a.lower() == arch.lower()]
    return {"architectures": same[:1]} if same else None


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)  # our replies; anything printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "close":
                break
            reply = worker.load(msg) if op == "load" else worker.generate(msg) if op == "generate" else \
                {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as err:  # noqa: BLE001 - every failure is reported to the harness, which raises it
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0][:2000],
                     "unsupported": isinstance(err, Unsupported)}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
