"""The shipped reference result set redraws every figure it has inputs for, from CSVs only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "results" / "reference"


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="no committed reference result set")
def test_make_figures_from_the_reference_set(tmp_path):
    res = subprocess.run([sys.executable, "make_figures.py", "--results", str(REFERENCE), "--figures", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    drawn = {p.stem for p in tmp_path.rglob("*.png")}
    # the main grid, the K sweep, routing diversity and the headline table come from every quick run
    assert any("tpot" in name for name in drawn), sorted(drawn)
    assert any("k_sweep" in name for name in drawn), sorted(drawn)
    assert any("routing" in name for name in drawn), sorted(drawn)
    assert list(tmp_path.rglob("*.pdf")) and list(tmp_path.rglob("*.md"))
