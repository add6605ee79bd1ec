"""Where a model's checkpoint comes from, and a clear error when it is not there."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from specter.models import tiny
from specter.models.facts import MODEL_TYPES
from specter.paths import file_sha256

if TYPE_CHECKING:
    from specter.models import tiny_train


class ModelUnavailable(RuntimeError):
    """The checkpoint is not on this machine; the message says how to get it."""


def _has_weights(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def resolve_checkpoint(name: str, source: str, trained: bool = False, local_dir: str | Path | None = None,
                       hf_id: str | None = None, revision: str | None = None,
                       routing: tiny_train.RoutingCheck | None = None) -> Path:
    """Folder holding config.json, *.safetensors and the tokenizer of a model.

    `source="tiny"`: a locally built tiny model (`trained` picks the briefly trained variant);
    `source="hub"`: real weights in `local_dir` or already in the Hugging Face cache (never downloads).
    `routing`: a trained tiny model's routing check, needed when it is trained here (see `ensure_trained`).
    """
    if source == "tiny":
        if name not in tiny.TINY_SPECS:
            raise ModelUnavailable(f"unknown tiny model {name!r}; choose one of {sorted(tiny.TINY_SPECS)}")
        return ensure_trained(name, routing=routing) if trained else tiny.ensure_tiny(name)
    local = Path(local_dir) if local_dir else None
    if local is not None and _has_weights(local):
        return local
    try:  # a copy already in the Hugging Face cache (never downloads here)
        from huggingface_hub import snapshot_download

        cached = Path(
            snapshot_download(hf_id, revision=revision, local_files_only=True)
        )
        if _has_weights(cached):
            return cached
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        pass
    where = f"{local.resolve()} and the Hugging Face cache" if local is not None else "the Hugging Face cache"
    raise ModelUnavailable(
        f"weights for {name} ({hf_id}) are not on this machine (looked in {where}). "
        f"Download them on a machine with internet access and a GPU: python -m initialization.download_models "
        f"{name} (set SPECTER_MODELS to choose the folder). On a CPU-only machine, use a tiny model of the same "
        f"architecture instead: model=tiny_dsv2, model=tiny_qwen or model=tiny_phi."
    )


def ensure_trained(name: str, root: Path | None = None, progress: bool = True,
                   routing: tiny_train.RoutingCheck | None = None) -> Path:
    """The trained tiny model, verified; trained on first use (a fixed number of steps, with a
    progress bar). Refused when it missed its quality gates or its files no longer match their
    recorded sha256. `routing` (specter.routing_stats.held_out_routing) checks the routing gates
    of a training run; it is required only when the model has to be trained."""
    import sys

    from specter.models import tiny_train

    path = tiny.tiny_dir(name, trained=True, root=root)
    rebuild = f"python -m initialization.train_tiny {name} (about {tiny_train.estimated_minutes(name):.0f} CPU minutes)"
    if _has_weights(path):  # read-only check first: a shared, read-only cache works
        problem = tiny_train.trained_problem(path)
        if problem:
            raise ModelUnavailable(f"the trained {name} in {path} cannot be used: {problem}. Rebuild it: {rebuild}")
        return path
    with tiny.build_lock(path):
        if not _has_weights(path):
            print(f"specter: training {name} once for {tiny_train.DEFAULT_STEPS[name]} steps (about "
                  f"{tiny_train.estimated_minutes(name):.0f} CPU minutes; later runs reuse it from {path})",
                  file=sys.stderr, flush=True)
            try:
                return tiny_train.train(name, root=root, progress=progress, routing=routing)
            except tiny_train.TrainingRejected as err:
                raise ModelUnavailable(str(err)) from None
        problem = tiny_train.trained_problem(path)
    if problem:
        raise ModelUnavailable(f"the trained {name} in {path} cannot be used: {problem}. Rebuild it: {rebuild}")
    return path


def checkpoint_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's weight files (name and content), in name order.

    Caches that depend on the weights (the GPTQ draft, the link calibration, the GGUF export) are
    keyed by it, so retrained or replaced weights never reuse a stale artifact. Each file's hash is
    remembered in `.specter-digest.json` beside it (`specter.paths.content_sha256`: keyed by size,
    mtime, ctime and inode, so an in-place change is always seen), so large checkpoints hash once.
    """
    from specter.paths import content_sha256, load_digest_memo, save_digest_memo

    checkpoint = Path(checkpoint)
    memo = load_digest_memo(checkpoint)
    h, changed = hashlib.sha256(), False
    for f in sorted(checkpoint.glob("*.safetensors")):
        digest, updated = content_sha256(f, memo)
        changed |= updated
        h.update(f"{f.name}|{digest}|".encode())
    if changed:
        save_digest_memo(checkpoint, memo)
    return h.hexdigest()




def checkpoint_problem(checkpoint: Path, model: str, real: str | None = None, offloads: bool = True) -> str | None:
    """Why `checkpoint` cannot be run as `model` (its config.json, architecture or weight files), or None.

    Reads config.json and every safetensors header (not the tensors): a truncated or corrupt file,
    another architecture than the model's (a Llama or Qwen checkpoint as model=dsv2) or a model
    without routed experts under an offloading method is refused before anything loads."""
    from specter.models.arch import ARCHS

    checkpoint = Path(checkpoint)
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return f"{checkpoint / 'config.json'} cannot be read ({err})"
    model_type = config.get("model_type")
    expected = MODEL_TYPES.get(real or model)
    if expected and model_type != expected:
        return (f"{checkpoint} holds a {model_type!r} model, not {model}'s architecture ({expected!r}); "
                "point model.local_dir at the right checkpoint or choose the matching model=")
    if offloads and model_type not in ARCHS:
        return (f"{checkpoint} holds a {model_type!r} model, which has no routed experts to offload (supported: "
                f"{sorted(ARCHS)})")
    from safetensors import safe_open

    for f in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                names = list(st.keys())
            size, end = f.stat().st_size, _safetensors_end(f)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            return f"{f} is truncated or corrupt: it cannot be read as safetensors ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        if not names or size != end:
            return f"{f} is truncated or corrupt (its header describes {end} bytes, the file has {size})"
    return None


def _safetensors_end(path: Path) -> int:
    """The file size a safetensors file's header describes (8-byte length, JSON header, data)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)
