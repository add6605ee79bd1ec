"""Deterministic tiny random-weight checkpoints of the three real MoE architectures.

Each tiny model keeps its real counterpart's routed-expert count, top-k, shared-expert layout,
attention type and routing function, and shrinks hidden size, depth and vocabulary. Dimensions
suit gptqmodel's CPU kernel (out_features % 16 == 0, in_features % 128 == 0 for every expert
linear, so GPTQ group size 128 applies unchanged) and llama.cpp's converters.

    python -m specter.models.tiny --help

Checkpoints are written once into the cache folder (`$SPECTER_HOME`, default `~/.cache/specter`)
with `save_pretrained` (safetensors) plus a byte-level BPE tokenizer trained locally on the Python
standard library's sources. The same seed gives the same bytes; `TINY_WEIGHT_SHA256` pins them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specter.paths import file_sha256, specter_home

TOKENIZER_VOCAB = 1024
TOKENIZER_CORPUS_BYTES = 4_000_000
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


@dataclass(frozen=True)
class TinySpec:
    """A tiny architecture: the transformers config class and its keyword arguments."""

    name: str
    real: str  # the real model it mirrors
    model_type: str
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


_COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=128,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=1,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    num_hidden_layers=4,
    intermediate_size=256,  # dense MLPs; in Phi the experts (~9x a DeepSeek expert: larger here too)
    num_attention_heads=2,
)

def _tiny(name: str, real: str, model_type: str, seed: int, **config: Any) -> TinySpec:
    return TinySpec(name, real, model_type, dict(_COMMON, **config), seed)


TINY_SPECS: dict[str, TinySpec] = {spec.name: spec for spec in (
    _tiny("tiny_dsv2", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2", seed=1,
          first_k_dense_replace=1,  # layer 0 is dense, as in DeepSeek-V2-Lite
          moe_intermediate_size=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
          topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, num_key_value_heads=2,
          kv_lora_rank=64, q_lora_rank=64,  # llama.cpp only treats 26/27-layer models as "lite" (no q_lora)
          qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, head_dim=64),
    _tiny("tiny_qwen", "Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe", seed=2,
          moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=60, num_experts_per_tok=4,
          norm_topk_prob=False, decoder_sparse_step=1, num_key_value_heads=2),
    _tiny("tiny_phi", "microsoft/Phi-3.5-MoE-instruct", "phimoe", seed=3,
          num_local_experts=16, num_experts_per_tok=2,
          num_key_value_heads=1,  # grouped-query attention
          router_jitter_noise=0.01, input_jitter_noise=0.0),
)}

# sha256 over (name, dtype, shape, bytes) of every tensor, in sorted name order; see `weights_digest`.
TINY_WEIGHT_SHA256: dict[str, str] = json.loads(
    (Path(__file__).with_name("tiny_checksums.json")).read_text()
) if Path(__file__).with_name("tiny_checksums.json").exists() else {}


def cpu_kind() -> str:
    """The CPU kernel family torch runs here (DEFAULT, AVX2, AVX512, ...): training's float results,
    and so a trained model's bytes, depend on it."""
    return torch.backends.cpu.get_cpu_capability()


def trained_pin(name: str) -> str | None:
    """The pinned digest of `name`'s trained weights for this CPU kind (`<name>-trained@<kind>`), if any."""
    return TINY_WEIGHT_SHA256.get(f"{name}-trained@{cpu_kind()}")


def tiny_dimension(name: str, key: str) -> int:
    """A tiny model's dimension as the run config names it (`num_experts`, `top_k`, `context_length`):
    the one source the model configs read through the `${tiny:<name>,<key>}` resolver."""
    kw = TINY_SPECS[name].config_kwargs
    lookup = {
        "num_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
        "top_k": ("num_experts_per_tok",),
        "context_length": ("max_position_embeddings",),
    }
    for field_name in lookup[key]:
        if field_name in kw:
            return int(kw[field_name])
    raise KeyError(f"{name} has no {key}")


def tiny_dir(name: str, trained: bool = False, root: Path | None = None) -> Path:
    root = root or specter_home() / "models"
    return root / (f"{name}-trained" if trained else name)


def make_config(name: str, **overrides):
    """The transformers config of a tiny model (a real config class of the real architecture);
    ``overrides`` are further config arguments (e.g. ``experts_implementation="eager"``)."""
    from transformers import AutoConfig

    spec = _spec(name)
    return AutoConfig.for_model(spec.model_type, **{**spec.config_kwargs, **overrides})


def _spec(name: str) -> TinySpec:
    if name not in TINY_SPECS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(TINY_SPECS)}")
    return TINY_SPECS[name]


def build_random_model(name: str) -> torch.nn.Module:
    """A fresh random-weight model; the same bytes for the same spec and library versions."""
    from transformers import AutoModelForCausalLM

    spec = _spec(name)
    config = make_config(name)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def weights_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in sorted name order."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ----------------------------------------------------------------------------------- tokenizer
def stdlib_corpus(max_bytes: int = TOKENIZER_CORPUS_BYTES) -> list[str]:
    """Python standard library sources in a fixed order: a text corpus every machine has offline."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(lib.glob("*.py")) + sorted((lib / "pydoc_data").glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE trained on `stdlib_corpus()`, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        model_input_names=["input_ids", "attention_mask"],
    )


# ------------------------------------------------------------------------------------- build
def file_sha256s(folder: Path) -> dict[str, str]:
    """sha256 of every weight file (`*.safetensors`) in `folder`, by file name."""
    return {f.name: file_sha256(f) for f in sorted(Path(folder).glob("*.safetensors"))}


def build_lock(out: Path):
    """An inter-process lock beside `out`, so concurrent first uses build a model once."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out.with_name(out.name + ".lock")))


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished build into place; the old folder, if any, is removed after the swap."""
    import shutil

    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)  # a half-built folder is never mistaken for a finished one
    shutil.rmtree(old, ignore_errors=True)


def tiny_problem(out: Path, name: str) -> str | None:
    """Why the built random tiny model in `out` must not be used, or None when it is intact.

    Its marker records each weight file's sha256; a marker without them (an older build) is
    checked once by loading the weights against the pinned digest, then completed.
    """
    try:
        marker = json.loads((out / "specter_tiny.json").read_text())
        files = marker.get("files")
    except (OSError, ValueError, AttributeError):
        return "its specter_tiny.json is missing or unreadable"
    if files is None:
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            digest = weights_digest(model.state_dict())
        except Exception as err:  # noqa: BLE001 - any load failure means "not intact"
            return f"its weights cannot be loaded ({type(err).__name__})"
        if digest != marker.get("weights_sha256") or digest != TINY_WEIGHT_SHA256.get(name, digest):
            return "its weights differ from the pinned checksum"
        from specter.paths import atomic_write_text

        try:
            atomic_write_text(out / "specter_tiny.json", json.dumps({**marker, "files": file_sha256s(out)}, indent=1))
        except OSError:  # a read-only cache: check by loading again next time
            pass
        return None
    actual = file_sha256s(out)
    if actual != files:
        bad = sorted(set(actual) ^ set(files) | {f for f in actual if files.get(f) != actual[f]})
        return f"{', '.join(bad)} does not match its recorded sha256 (changed or truncated)"
    return None


def ensure_tiny(name: str, root: Path | None = None, force: bool = False) -> Path:
    """Build `name` into the cache once (weights + tokenizer), verify it, and return its folder.

    A build whose weight files no longer match their recorded sha256 (truncated, overwritten) is
    rebuilt: the same seed gives the same bytes.
    """
    import sys

    out = tiny_dir(name, root=root)
    if not force and (out / "specter_tiny.json").exists() and tiny_problem(out, name) is None:
        return out  # intact: nothing written, no lock needed (a read-only cache works)
    with build_lock(out):
        if (out / "specter_tiny.json").exists() and not force:
            problem = tiny_problem(out, name)
            if problem is None:  # built meanwhile by another process
                return out
            print(f"specter: rebuilding the tiny model {name} in {out}: {problem}", file=sys.stderr, flush=True)
        tmp = out.with_name(out.name + ".partial")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        model = build_random_model(name)
        digest = weights_digest(model.state_dict())
        pinned = TINY_WEIGHT_SHA256.get(name)
        model.save_pretrained(tmp, safe_serialization=True)
        train_tokenizer().save_pretrained(tmp)
        (tmp / "specter_tiny.json").write_text(json.dumps(
            {"name": name, "real": _spec(name).real, "weights_sha256": digest, "pinned": digest == pinned,
             "files": file_sha256s(tmp)}, indent=1))
        replace_dir(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the tiny random-weight MoE checkpoints into the cache.")
    ap.add_argument("names", nargs="*", default=sorted(TINY_SPECS), help="which tiny models (default: all)")
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    ap.add_argument("--print-digests", action="store_true", help="print the weight checksums as JSON")
    args = ap.parse_args(argv)
    digests = {}
    for name in args.names:
        path = ensure_tiny(name, force=args.force)
        digests[name] = json.loads((path / "specter_tiny.json").read_text())["weights_sha256"]
        print(f"{name}: {path}")
    if args.print_digests:
        print(json.dumps(digests, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
