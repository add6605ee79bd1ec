"""Where a model's checkpoint comes from, and a clear error when it is not there."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specter.models import tiny
from specter.paths import file_sha256


class ModelUnavailable(RuntimeError):
    """The checkpoint is not on this machine; the message says how to get it."""


def _has_weights(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def resolve_checkpoint(name: str, source: str, trained: bool = False, local_dir: str | Path | None = None,
                       hf_id: str | None = None, revision: str | None = None) -> Path:
    """Folder holding config.json, *.safetensors and the tokenizer of a model.

    `source="tiny"`: a locally built tiny model (`trained` picks the briefly trained variant);
    `source="hub"`: real weights in `local_dir` or already in the Hugging Face cache (never downloads).
    """
    if source == "tiny":
        if name not in tiny.TINY_SPECS:
            raise ModelUnavailable(f"unknown tiny model {name!r}; choose one of {sorted(tiny.TINY_SPECS)}")
        return ensure_trained(name) if trained else tiny.ensure_tiny(name)
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


def ensure_trained(name: str, root: Path | None = None, progress: bool = True) -> Path:
    """The trained tiny model, verified; trained on first use (a fixed number of steps, with a
    progress bar). Refused when it missed its quality gates or its files no longer match their
    recorded sha256."""
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
                return tiny_train.train(name, root=root, progress=progress)
            except tiny_train.TrainingRejected as err:
                raise ModelUnavailable(str(err)) from None
        problem = tiny_train.trained_problem(path)
    if problem:
        raise ModelUnavailable(f"the trained {name} in {path} cannot be used: {problem}. Rebuild it: {rebuild}")
    return path


def checkpoint_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's weight files (name and content), in name order.

    Caches that depend on the weights (the GPTQ draft, the link calibration) are keyed by it, so
    retrained or replaced weights never reuse a stale artifact. Each file's hash is remembered in
    `.specter-digest.json` beside it, keyed by size and mtime, so large checkpoints hash once.
    """
    checkpoint = Path(checkpoint)
    memo_path = checkpoint / ".specter-digest.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h, changed = hashlib.sha256(), False
    for f in sorted(checkpoint.glob("*.safetensors")):
        st = f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = memo.get(f.name)
        if not entry or entry.get("stamp") != stamp:
            entry, changed = {"stamp": stamp, "sha256": file_sha256(f)}, True
            memo[f.name] = entry
        h.update(f"{f.name}|{entry['sha256']}|".encode())
    if changed:
        try:
            from specter.paths import atomic_write_text

            atomic_write_text(memo_path, json.dumps(memo, indent=1))
        except OSError:  # a read-only checkpoint folder: hash again next time
            pass
    return h.hexdigest()
