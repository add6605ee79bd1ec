"""The real-width rehearsal (scripts/rehearse_real.py): each real architecture at its real widths and
vocabulary, 2 layers, random weights, through every method at both tiers' slot counts. Minutes per
model and several GB of memory and temp space: marked slow, and run only with SPECTER_REHEARSAL=1
(`SPECTER_REHEARSAL=1 python -m pytest tests/test_rehearse_real.py`), so CI's default run skips it."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECTER_REHEARSAL") != "1", reason="the real-width rehearsal: set SPECTER_REHEARSAL=1")
@pytest.mark.parametrize("model", ["dsv2", "qwen15moe", "phi35moe"])
def test_real_width_rehearsal(model, tmp_path):
    quant = "gptq" if importlib.util.find_spec("gptqmodel") else "rtn"
    out = tmp_path / "rehearsal.csv"
    proc = subprocess.run(["bash", "scripts/rehearse_real.sh", "--models", model, "--workdir", str(tmp_path),
                           "--csv", str(out)], cwd=REPO, env={**os.environ, "QUANT": quant},
                          capture_output=True, text=True, timeout=3 * 3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = list(csv.DictReader(out.open()))
    methods = {(r["tier"], r["method"]) for r in rows}
    for tier in ("high", "low"):
        for method in ("offload_ar", "specter", "mo_sm", "specmoeoff"):
            assert (tier, method) in methods
        assert (tier, "specter (budget - 1 MB)") in methods
    assert all(r["footprint_equal"] == "True" for r in rows if r["footprint_equal"])
    assert all(r["tokens_equal"] == "True" for r in rows if r["tokens_equal"])
