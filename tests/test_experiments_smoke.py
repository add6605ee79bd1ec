"""Every experiment config composes and runs end to end for a few tokens (lightning-hydra style)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES, compose

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# Shrink every protocol to seconds; each experiment's own keys are kept otherwise.
TINY = ["num_prompts=1", "repeats=1", "max_new_tokens=6", "warmup_tokens=0", "progress=false",
        f"assets_dir={FIXTURES / 'datasets'}", "allow_hub=false"]
PER_EXPERIMENT = {
    "k_sweep": ["k_sweep.values=[2]", "method.quant=rtn", "dataset=humaneval"],
    "batch": ["batch.sizes=[2]", "method.quant=rtn", "dataset=humaneval"],
    "main": ["method=specter", "method.quant=rtn", "K=2"],
}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_config_runs(name, tiny_checkpoint, tmp_path):
    from specter.harness.experiments import run_experiment

    tiny_checkpoint("tiny_qwen")
    cfg = compose([f"experiment={name}", "model=tiny_qwen", *TINY, *PER_EXPERIMENT.get(name, []),
                   f"output_dir={tmp_path / name}"])
    run_experiment(cfg)
    written = list((tmp_path / name).rglob("records.csv"))
    assert written and all(p.stat().st_size > 0 for p in written)
