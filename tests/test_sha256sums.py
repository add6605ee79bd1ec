"""SHA256SUMS pins the committed data files (fixtures, constraints, tiny-model checksums)."""

from __future__ import annotations

import hashlib

from conftest import REPO


def test_sha256sums_match():
    lines = (REPO / "SHA256SUMS").read_text().splitlines()
    assert lines
    for line in lines:
        digest, name = line.split(maxsplit=1)
        path = REPO / name.strip()
        assert path.exists(), f"{name} listed in SHA256SUMS is missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{name} changed; regenerate SHA256SUMS knowingly"
