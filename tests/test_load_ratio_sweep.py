"""experiment=load_ratio_sweep: every (model, tier, r, method) cell is an ordinary run; one table row each."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import FIXTURES, compose
from specter.experiments import cli as cli_mod
from specter.assembly.config import ConfigError
from specter.experiments.load_ratio_sweep import cell_config, sweep_settings


def test_defaults_are_the_issue_grid():
    cfg = compose(["experiment=load_ratio_sweep"])
    models, tiers, ratios, methods = sweep_settings(cfg)
    assert ratios == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0] and tiers == ["high", "low"]
    assert methods == ["target_only", "offload_ar", "mo_sm", "specmoeoff", "specter"]
    assert cfg.hardware.name == "emulated" and cfg.model.trained is True and models == [cfg.model.name]


def test_a_cell_switches_model_tier_method_and_ratio(tmp_path):
    cfg = compose(["experiment=load_ratio_sweep", "model=tiny_dsv2"])
    sub = cell_config(cfg, "tiny_phi", "low", "mo_sm", 4.0, tmp_path / "c")
    assert (sub.model.name, sub.memory.name, sub.method.name, sub.model.load_ratio) == ("tiny_phi", "low", "mo_sm", 4.0)
    assert sub.model.trained is True and sub.experiment == "run" and sub.output_dir == str(tmp_path / "c")


@pytest.mark.parametrize("override,needle", [("hardware=cpu", "hardware=emulated"),
                                             ("hardware.bandwidth_gbps=5", "bandwidth_gbps"),
                                             ("load_ratio_sweep.ratios=[0,1]", "> 0")])
def test_bad_sweeps_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle):
        sweep_settings(compose(["experiment=load_ratio_sweep", override]))


@pytest.mark.slow  # three runs end to end (about 30 s on a quiet 2-core machine)
def test_a_small_sweep_writes_one_row_per_cell(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "sweep"
    args = ["experiment=load_ratio_sweep", "model=tiny_qwen", "model.trained=false", "num_prompts=1",
            "max_new_tokens=2", "warmup_tokens=0", "progress=false", f"assets_dir={FIXTURES / 'datasets'}",
            "load_ratio_sweep.ratios=[0.5,4]", "load_ratio_sweep.methods=[target_only,offload_ar]",
            "load_ratio_sweep.tiers=[low]", "load_ratio_sweep.points=[legacy]", "hardware.ratio_probe_steps=3",
            f"output_dir={out}"]
    threads = torch.get_num_threads()
    try:
        assert cli_mod.main(args) == 0, capsys.readouterr().err[-2000:]
    finally:
        torch.set_num_threads(threads)
    table = pd.read_csv(out / "load_ratio.csv")
    assert sorted(zip(table.method, table.load_ratio)) == [("offload_ar", 0.5), ("offload_ar", 0.7), ("offload_ar", 4.0),
                                                            ("target_only", 0.5), ("target_only", 0.7),
                                                            ("target_only", 4.0)]
    assert set(table[table.load_ratio == 0.7].point) == {"legacy estimate"}  # the named point, per model
    assert (out / "tiny_qwen" / "low" / "r=0.5" / "offload_ar" / "records.csv").exists()
    assert (out / "tiny_qwen" / "target_only" / "records.csv").exists()
    linked = table[table.method == "offload_ar"].set_index("load_ratio")
    assert linked.effective_load_ratio.notna().all()
    assert table[table.method == "target_only"].effective_load_ratio.isna().all()
