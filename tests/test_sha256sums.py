"""SHA256SUMS pins the committed data files (fixtures, constraints, tiny-model checksums, reference results)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from conftest import REPO


def test_sha256sums_match():
    lines = (REPO / "SHA256SUMS").read_text().splitlines()
    assert lines
    for line in lines:
        digest, name = line.split(maxsplit=1)
        path = REPO / name.strip()
        assert path.exists(), f"{name} listed in SHA256SUMS is missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{name} changed; regenerate SHA256SUMS knowingly"


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git repository")
def test_sha256sums_lists_every_pinned_file():
    """A file committed under a pinned folder (scripts/checksums.py PINNED) must be listed: an added one fails.
    Regenerate with `python scripts/checksums.py write --pinned`."""
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "checksums.py"), "verify", "--pinned"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
