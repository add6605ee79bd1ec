"""Where a model's checkpoint comes from, and a clear error when it is not there."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specter.models import tiny


class ModelUnavailable(RuntimeError):
    """The checkpoint is not on this machine; the message says how to get it."""


def _has_weights(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def resolve_checkpoint(model_cfg: DictConfig) -> Path:
    """Folder holding config.json, *.safetensors and the tokenizer for `model_cfg`."""
    if model_cfg.source == "tiny":
        if model_cfg.get("trained"):
            path = tiny.tiny_dir(model_cfg.name, trained=True)
            if not _has_weights(path):
                raise ModelUnavailable(
                    f"the briefly trained {model_cfg.name} is not built yet ({path}).\n"
                    f"Build it (a few CPU minutes): python initialization/train_tiny.py {model_cfg.name}"
                )
            return path
        return tiny.ensure_tiny(model_cfg.name)
    local = Path(model_cfg.local_dir)
    if _has_weights(local):
        return local
    try:  # a copy already in the Hugging Face cache (never downloads here)
        from huggingface_hub import snapshot_download

        cached = Path(
            snapshot_download(model_cfg.hf_id, revision=model_cfg.get("revision"), local_files_only=True)
        )
        if _has_weights(cached):
            return cached
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        pass
    raise ModelUnavailable(
        f"weights for {model_cfg.name} ({model_cfg.hf_id}) are not on this machine "
        f"(looked in {local} and the Hugging Face cache).\n"
        f"  Download them on a machine with internet access and a GPU:\n"
        f"    python initialization/download_models.py {model_cfg.name}\n"
        f"  (set SPECTER_MODELS to choose the folder). On a CPU-only machine, use a tiny model of the\n"
        f"  same architecture instead: model=tiny_dsv2, model=tiny_qwen or model=tiny_phi."
    )
