"""run.py end to end on each tiny architecture: records, resume, no-overwrite.

Bad input (one-line errors) is covered case by case in test_bad_input.py."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import FIXTURES, run_cli
from specter.records.records import COLUMNS

ASSETS = f"assets_dir={FIXTURES / 'datasets'}"
FAST = ["num_prompts=2", "repeats=1", "max_new_tokens=6", "warmup_tokens=2", "progress=false", ASSETS]


@pytest.mark.parametrize("model", ["tiny_dsv2", "tiny_qwen", "tiny_phi"])
def test_target_only_writes_records(model, tmp_path, tiny_checkpoint):
    tiny_checkpoint(model)
    out = tmp_path / "run"
    res = run_cli(["method=target_only", f"model={model}", "dataset=humaneval", *FAST, f"output_dir={out}"])
    assert res.returncode == 0, res.stderr[-2000:]
    records = pd.read_csv(out / "records.csv")
    assert tuple(records.columns) == COLUMNS
    assert len(records) == 2 and (records.new_tokens == 6).all()
    assert records.tpot_ms.gt(0).all() and records.output_digest.str.len().eq(64).all()
    assert records.accepted_fraction.isna().all()  # not a speculative method: empty, not a fake number
    regime = ["hit_rate", "window_experts", "window_experts_vs_independent"]
    assert records[regime].isna().all(axis=None)  # every expert resident: no cache, no offloaded routes
    for name in ("summary.csv", "config.yaml", "env.json"):
        assert (out / name).exists()
    assert "summary.csv" in res.stdout
    summary = pd.read_csv(out / "summary.csv")
    assert set(regime) <= set(summary.columns) and summary[regime].isna().all(axis=None)
    env = __import__("json").loads((out / "env.json").read_text())
    assert "model_routing" in env and env["model_routing"] is None  # the untrained tiny model has no report


def test_resume_keeps_finished_records_and_never_overwrites(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    out = tmp_path / "run"
    args = ["method=target_only", "model=tiny_qwen", "dataset=gsm8k", *FAST, f"output_dir={out}"]
    assert run_cli(args).returncode == 0
    first = pd.read_csv(out / "records.csv")
    # simulate an interrupted run: drop the last record, rerun the same command
    (out / "records.csv").write_text("\n".join((out / "records.csv").read_text().splitlines()[:-1]) + "\n")
    res = run_cli(args)
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = pd.read_csv(out / "records.csv")
    assert len(resumed) == 2
    assert resumed.iloc[0].equals(first.iloc[0])  # the finished record was kept as it was
    assert resumed.output_digest.tolist() == first.output_digest.tolist()  # per-record seeds: same tokens
    # a complete folder: nothing runs, nothing is rewritten
    before = (out / "records.csv").read_bytes()
    res = run_cli(args)
    assert res.returncode == 0 and "nothing to run" in res.stdout
    assert (out / "records.csv").read_bytes() == before
    # a different configuration pointed at the same folder is refused
    res = run_cli([*args[:-1], "max_new_tokens=7", f"output_dir={out}"])
    assert res.returncode != 0 and "different configuration" in res.stderr
    assert (out / "records.csv").read_bytes() == before


def test_specter_end_to_end_with_lossless_check(tmp_path, tiny_checkpoint):
    tiny_checkpoint("tiny_dsv2")
    out = tmp_path / "spec"
    res = run_cli(["method=specter", "method.quant=rtn", "model=tiny_dsv2", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=1",
                   "hardware.latency_us=10", "K=4", "verify_lossless=true", "dataset=humaneval", *FAST,
                   f"output_dir={out}"])
    assert res.returncode == 0, res.stderr[-2000:]
    rec = pd.read_csv(out / "records.csv")
    assert (rec.K == 4).all() and (rec.draft_quant == "rtn").all()  # labelled: not the paper's GPTQ draft
    assert rec.drafted_tokens.gt(0).all() and rec.accepted_fraction.between(0, 1).all()
    assert (rec.oracle_h2d_bytes <= rec.h2d_bytes).all()
    assert rec.prefetch_recall.notna().all() and rec.mean_accepted_len.ge(1).all()
    assert rec.hit_rate.between(0, 1).all()  # the routing regime: device cache and verification windows
    assert rec.hit_rate.tolist() == pytest.approx((rec.demand_hits / (rec.demand_hits + rec.demand_misses)).tolist())
    assert rec.window_experts.between(6, 64).all()  # top-6 of 64 routed experts, per window and MoE layer
    assert (rec.window_experts_vs_independent > 0).all() and (rec.window_experts_vs_independent <= 1.5).all()
    summary = pd.read_csv(out / "summary.csv")
    assert summary.hit_rate.iloc[0] == pytest.approx(rec.hit_rate.mean())
    assert summary.window_experts_vs_independent.iloc[0] == pytest.approx(rec.window_experts_vs_independent.mean())
    env = __import__("json").loads((out / "env.json").read_text())
    assert env["model_routing"] is None
    assert env["method"]["link"]["kind"] == "emulated" and env["method"]["draft_bytes"] > 0
