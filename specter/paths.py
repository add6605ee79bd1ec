"""Where Specter keeps what it builds once and reuses (tiny checkpoints, drafts, link calibration),
and how it writes files that must never be seen half-written."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def specter_home() -> Path:
    """Root of Specter's cache: `$SPECTER_HOME`, else ~/.cache/specter."""
    return Path(os.environ.get("SPECTER_HOME", Path.home() / ".cache" / "specter"))


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder, fsync, rename: readers see old or new, never half."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`atomic_write_text` for bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, read in chunks (weights, dataset files, draft archives)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
