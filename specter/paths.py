"""Where Specter keeps what it builds once and reuses (tiny checkpoints, drafts, link calibration),
how it writes files that must never be seen half-written, which configured names may become part
of a path (`safe_name`, the one rule), and content digests of large files (`content_sha256`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any


class PathError(ValueError):
    """A configured name that cannot be a path component, or a file that cannot be written."""


class UnsafeName(PathError):
    """A name from the configuration that would not stay one folder or file name."""


# One file or folder name: starts with a letter or digit, then letters, digits, '.', '_', '+', '-',
# '=' (never '/', never '..' as a whole, never a leading dot or dash); at most 128 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def safe_name(value: Any, what: str) -> str:
    """`value` as a path component, or UnsafeName naming the setting (`what`) and the rule.

    Every configured name that becomes part of a path (model.name, method.name, memory.name,
    hardware.name, compare.methods entries, ...) passes through here, so none can leave its folder."""
    text = "" if value is None else str(value)
    if not SAFE_NAME.fullmatch(text) or ".." in text:
        raise UnsafeName(f"{what}={text!r} cannot be used as a file or folder name: use letters, digits and "
                         "'._+=-' only (starting with a letter or digit, no '..', at most 128 characters)")
    return text


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


def write_table(path: Path, table: Any) -> None:
    """A pandas DataFrame as CSV, written atomically; PathError (one line) when it cannot be."""
    try:
        atomic_write_text(Path(path), table.to_csv(index=False))
    except OSError as err:
        raise PathError(f"cannot write {path} ({err.strerror or err})") from None


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, read in chunks (weights, dataset files, draft archives)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


DIGEST_MEMO = ".specter-digest.json"
RACY_NS = 2_000_000_000  # a file changed this recently is hashed again next time (see content_sha256)


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def content_sha256(path: Path, memo: dict[str, Any] | None = None) -> tuple[str, bool]:
    """(sha256 of the file's bytes, whether `memo` changed), hashing once per file content.

    `memo` maps a file name to {"stamp", "sha256"}. The stamp is size, mtime, ctime and inode: an
    in-place change that keeps the size and restores the mtime still moves the ctime (which no
    user call can set back), and a replaced file has another inode. A file whose ctime is within
    `RACY_NS` of the hash is not remembered (its content may change again within the clock's
    resolution), so it is hashed again on its next use.
    """
    path = Path(path)
    st = path.stat()
    entry = (memo or {}).get(path.name)
    if entry and entry.get("stamp") == _stamp(st) and isinstance(entry.get("sha256"), str):
        return entry["sha256"], False
    started = time.time_ns()
    digest = file_sha256(path)
    after = path.stat()
    if memo is None or _stamp(after) != _stamp(st) or started - after.st_ctime_ns < RACY_NS:
        if memo is not None and path.name in memo:
            del memo[path.name]
            return digest, True
        return digest, False
    memo[path.name] = {"stamp": _stamp(st), "sha256": digest}
    return digest, True


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; empty when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def load_digest_memo(folder: Path) -> dict[str, Any]:
    """The digest memo of a folder (empty when missing or unreadable: everything is hashed again)."""
    return read_json_object(Path(folder) / DIGEST_MEMO)


def save_digest_memo(folder: Path, memo: dict[str, Any]) -> None:
    """Write the memo atomically; a read-only folder is fine (its files are hashed again next time)."""
    try:
        atomic_write_text(Path(folder) / DIGEST_MEMO, json.dumps(memo, indent=1, sort_keys=True))
    except OSError:
        pass


def cached_sha256(path: Path) -> str:
    """`content_sha256` of one file, with the memo of its folder."""
    path = Path(path)
    memo = load_digest_memo(path.parent)
    digest, changed = content_sha256(path, memo)
    if changed:
        save_digest_memo(path.parent, memo)
    return digest
