"""Download the real models' weights (needs internet access) and pin the revision used.

    python initialization/download_models.py dsv2            # DeepSeek-V2-Lite
    python initialization/download_models.py qwen15moe phi35moe --dest /data/models

Weights go to `<dest>/<folder>` (dest defaults to $SPECTER_MODELS or ./models, the folder the
model configs look in). The resolved commit of each repository is written to
`initialization/model-revisions.json`, so later downloads and every run record the same bytes.
Afterwards each file's sha256 is written to `<folder>/SHA256SUMS` and checked on reruns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
REVISIONS = Path(__file__).with_name("model-revisions.json")
REAL_MODELS = ("dsv2", "qwen15moe", "phi35moe")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_or_write_sums(folder: Path) -> list[str]:
    """Write SHA256SUMS on first download; on later runs return the files that no longer match."""
    sums = folder / "SHA256SUMS"
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "SHA256SUMS" and ".cache" not in p.parts)
    if not sums.exists():
        sums.write_text("".join(f"{sha256_file(p)}  {p.relative_to(folder)}\n" for p in files))
        return []
    bad = []
    for line in sums.read_text().splitlines():
        digest, name = line.split("  ", 1)
        path = folder / name
        if not path.exists() or sha256_file(path) != digest:
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Download and verify the real MoE checkpoints.")
    ap.add_argument("models", nargs="+", choices=REAL_MODELS)
    ap.add_argument("--dest", default=os.environ.get("SPECTER_MODELS", "models"), help="parent folder")
    args = ap.parse_args(argv)
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError:
        print("error: huggingface_hub is not installed (pip install -e .)", file=sys.stderr)
        return 2
    pinned = json.loads(REVISIONS.read_text()) if REVISIONS.exists() else {}
    for name in args.models:
        cfg = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
        folder = Path(args.dest) / Path(str(cfg.local_dir).split("/")[-1])
        revision = cfg.get("revision") or pinned.get(name)
        try:
            if revision is None:
                revision = HfApi().model_info(cfg.hf_id).sha
            snapshot_download(cfg.hf_id, revision=revision, local_dir=folder,
                              allow_patterns=["*.json", "*.safetensors", "*.model", "*.py", "*.txt"])
        except Exception as err:  # noqa: BLE001 - offline, gated, disk full: one clear line
            print(f"error: could not download {cfg.hf_id}: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
            print("  This needs internet access to the Hugging Face hub. On CPU-only machines use "
                  "model=tiny_dsv2 / tiny_qwen / tiny_phi instead.", file=sys.stderr)
            return 2
        pinned[name] = revision
        REVISIONS.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        bad = verify_or_write_sums(folder)
        if bad:
            print(f"error: {folder}: checksum mismatch for {bad}; delete them and rerun", file=sys.stderr)
            return 2
        print(f"{name}: {cfg.hf_id}@{revision} -> {folder} (verified)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
