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
    "compare": ["model.trained=false", "+compare.method_overrides={specter:{quant:rtn}}", "dataset=humaneval"],
    "load_ratio_sweep": ["model.trained=false", "load_ratio_sweep.ratios=[2]", "load_ratio_sweep.methods=[offload_ar]",
                         "load_ratio_sweep.tiers=[low]", "hardware.ratio_probe_steps=3"],
    "project": ["project.tokens=4", "project.quant=rtn", "project.k_values=[2]", "project.profile=[specter]"],
}

OUTPUT = {"plan": "plan.csv", "project": "projection.csv"}  # the plan and the projection measure nothing: they write tables


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_config_runs(name, tiny_checkpoint, tmp_path):
    from specter.experiments.dispatch import run_experiment

    tiny_checkpoint("tiny_qwen")
    cfg = compose([f"experiment={name}", "model=tiny_qwen", *TINY, *PER_EXPERIMENT.get(name, []),
                   f"output_dir={tmp_path / name}"])
    run_experiment(cfg)
    written = list((tmp_path / name).rglob(OUTPUT.get(name, "records.csv")))
    assert written and all(p.stat().st_size > 0 for p in written)
    if name == "compare":  # the routing regime of each method: empty for target_only (every expert resident)
        import pandas as pd

        t = pd.read_csv(tmp_path / name / "compare.csv").set_index("method")
        assert t.hit_rate.isna()["target_only"] and t.window_experts_vs_independent.isna()["target_only"]
        for method in ("offload_ar", "specter"):  # autoregressive and speculative
            assert 0 <= t.loc[method, "hit_rate"] <= 1
            assert 0 < t.loc[method, "window_experts_vs_independent"] <= 1.5


def test_comparison_table_flags_differing_tokens():
    import pandas as pd

    from specter.experiments.compare import comparison_table

    rec = pd.DataFrame({
        "method": ["target_only", "offload_ar", "specter"], "dataset": ["he"] * 3, "prompt_index": [0] * 3,
        "repeat": [0] * 3, "tpot_ms": [10.0, 30.0, 15.0], "output_digest": ["a", "a", "b"],
        "acceptance_alpha": [None, None, 0.9], "mean_accepted_len": [None, None, 4.0],
        "h2d_bytes": [None, 300.0, 200.0], "oracle_h2d_bytes": [None, 100.0, 100.0], "new_tokens": [10] * 3,
        "hit_rate": [None, 0.25, 0.5], "window_experts_vs_independent": [None, 0.9, 0.6],
    })
    t = comparison_table(rec).set_index("method")
    assert t.loc["specter", "speedup_vs_offload_ar"] == 2.0
    assert t.loc["specter", "h2d_over_oracle"] == 2.0
    assert bool(t.loc["offload_ar", "same_tokens_as_target_only"]) and not bool(t.loc["specter", "same_tokens_as_target_only"])
    assert t.loc["specter", "hit_rate"] == 0.5 and t.loc["offload_ar", "window_experts_vs_independent"] == 0.9
    assert pd.isna(t.loc["target_only", "hit_rate"]) and pd.isna(t.loc["target_only", "window_experts_vs_independent"])
    old = comparison_table(rec.drop(columns=["hit_rate", "window_experts_vs_independent"]))  # records without them
    assert old.hit_rate.isna().all() and old.window_experts_vs_independent.isna().all()


def test_comparison_prints_short_routing_headers(capsys):
    import pandas as pd

    from specter.experiments.compare import comparison_table, print_comparison

    rec = pd.DataFrame({"method": ["target_only", "specter"], "dataset": ["he"] * 2, "prompt_index": [0] * 2,
                        "repeat": [0] * 2, "tpot_ms": [10.0, 5.0], "output_digest": ["a", "a"],
                        "acceptance_alpha": [None, 0.9], "mean_accepted_len": [None, 4.0], "h2d_bytes": [None, 200.0],
                        "oracle_h2d_bytes": [None, 100.0], "new_tokens": [10] * 2, "hit_rate": [None, 0.375],
                        "window_experts_vs_independent": [None, 0.625]})
    print_comparison(comparison_table(rec), title="t")
    out = capsys.readouterr().out
    assert "hit" in out and "WS÷ind" in out and "0.375" in out and "0.625" in out

