"""Batched decoding on the virtual clock (specter/projection/batching.py): a row per B = 1 .. 32 for Specter and
SpecMoEOff, commits stamped on the compute stream, each request's output its B = 1 output, and the paper's
batching claims set beside the same ratios from the table."""

from __future__ import annotations

import pytest

from conftest import compose

SIZES = [1, 2, 4, 8, 16, 32]
FAST = ["experiment=project", "model=dsv2", "memory=high", "project.quant=rtn", "project.warmup_tokens=4",
        "project.batch_new_tokens=5", "project.routes=independent"]


@pytest.fixture(scope="module")
def batch():
    from specter.experiments.project import method_slots
    from specter.projection.cost_model import cost_model
    from specter.projection.steps import Proxy, batch_step

    cfg = compose(FAST)
    slots, K = method_slots(cfg, "dsv2")
    px = Proxy(cfg, "tiny_dsv2", slots, K, "dsv2")
    cm = cost_model("dsv2", "a100_40gb_pcie4")
    base = {"model": "dsv2", "memory": "high", "device": cm.d.name, "draft": "RTN INT4 g128"}
    return batch_step(px, cm, base), px, cm


def test_the_batch_table_has_every_B_from_1_to_32(batch):
    rows = batch[0]
    assert compose(["experiment=project"]).project.batch_sizes == SIZES
    for method in ("specter", "specmoeoff"):
        mine = [r for r in rows if r["method"] == method]
        assert [int(r["batch_size"]) for r in mine] == SIZES
        assert [int(r["new_tokens"]) for r in mine] == [5 * b for b in SIZES]
        assert mine[0]["tpot_vs_b1"] == "1.0000" and mine[0]["throughput_vs_b1"] == "1.0000"
        assert all(float(r["tpot_ms"]) > 0 and float(r["throughput_tok_s"]) > 0 for r in mine)
        assert all(r["device"] == "a100_40gb_pcie4" and r["draft"] == "RTN INT4 g128" for r in mine)
    assert {r["K"] for r in rows if r["method"] == "specter"} == {"16"}  # the paper's setup: its K


def test_throughput_is_tokens_over_the_span_of_virtual_commits(batch):
    """A batch's span and its TPOTs are virtual seconds: at B = 32 the span covers 160 tokens, so throughput
    is far above what one request's TPOT allows alone (and no wall clock of this machine enters)."""
    rows = batch[0]
    for method in ("specter", "specmoeoff"):
        b1, b32 = (next(r for r in rows if r["method"] == method and r["batch_size"] == str(b)) for b in (1, 32))
        # 32 requests share the span: the batch's throughput is far above one request's at that TPOT
        assert float(b32["throughput_tok_s"]) > 4 * 1e3 / float(b32["tpot_ms"])
        assert float(b32["throughput_tok_s"]) > float(b1["throughput_tok_s"])
        # B = 1: the span holds the prefill and 4 TPOTs, so 5 tokens / span <= 5 / (4 TPOT)
        assert float(b1["throughput_tok_s"]) <= 1.25e3 / float(b1["tpot_ms"]) * (1 + 1e-3)


def test_each_request_keeps_its_B1_output(batch):
    from specter.projection.batching import prepare_batching, run_batches
    from specter.projection.engine_run import close, open_method

    _, px, cm = batch
    prompts = px.prompts(0, 4)
    session = open_method(px.config("specter"), px.checkpoint, cm, prepare=prepare_batching)
    try:
        points = run_batches(session, 0, prompts, [1, 4], 5, 4, progress=lambda _: None)
    finally:
        close(session)
    assert points[1].outputs[0] == points[0].outputs[0] and len(points[1].outputs) == 4


def test_batch_vs_paper_sets_each_claim_beside_the_projected_ratio():
    from specter.experiments.project import batch_vs_paper, paper_claims

    def row(method, B, tpot, tput, ws):
        return {"method": method, "batch_size": str(B), "tpot_ms": str(tpot), "throughput_tok_s": str(tput),
                "working_set": str(ws)}

    rows = [row("specter", 1, 10.0, 100.0, 40.0), row("specter", 2, 15.0, 130.0, 50.0),
            row("specter", 16, 16.0, 1000.0, 60.0), row("specter", 32, 16.5, 941.0, 62.0),
            row("specmoeoff", 1, 20.0, 50.0, 30.0), row("specmoeoff", 2, 30.0, 60.0, 35.0),
            row("specmoeoff", 16, 80.0, 250.0, 50.0), row("specmoeoff", 32, 99.0, 300.0, 55.0)]
    claims = paper_claims("dsv2")
    assert {c["claim"] for c in claims} >= {"batch_tpot_ratio", "batch_throughput_ratio", "batch_tpot_speedup"}
    out = {(v["claim"], v["batch_from"], v["batch_to"]): v for v in batch_vs_paper(rows, claims, {})}
    assert out["batch_tpot_ratio", "1", "32"]["paper"] == "1.65"
    assert float(out["batch_tpot_ratio", "1", "32"]["projected"]) == pytest.approx(1.65)
    assert float(out["batch_throughput_ratio", "1", "32"]["projected"]) == pytest.approx(9.41)
    assert float(out["batch_working_set_ratio", "1", "2"]["projected"]) == pytest.approx(1.25)
    speed = out["batch_tpot_speedup", "32", "32"]
    assert speed["paper"] == "6.02" and float(speed["projected"]) == pytest.approx(6.0)
    assert speed["projected_max_at"] == "32"
    gain = out["batch_throughput_gain", "16", "16"]
    assert float(gain["projected"]) == pytest.approx(4.0) and gain["projected_max_at"] == "16"
    assert paper_claims("phi35moe") == []  # the paper batched DeepSeek-V2-Lite and Qwen1.5-MoE only
