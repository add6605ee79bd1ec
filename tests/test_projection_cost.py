import pytest

from specter.projection.cost_model import cost_model, load_device, sensitivity

A100_BW = 1.555e12 * 0.8  # device file: HBM x efficiency
LAUNCH = 5e-6


def test_dsv2_layer_by_hand():
    c = cost_model("dsv2", "a100_40gb_pcie4")
    # q 2048*16*192 + kv_a 2048*(512+64) + kv_b 512*16*(128+128) + o 16*128*2048
    assert c.s.attn_params == 6_291_456 + 1_179_648 + 2_097_152 + 4_194_304
    assert c.expert_bytes() == 3 * 2048 * 1408 * 2 == 17_301_504
    assert c.s.moe_layers == 26 and c.s.shared_params == 2 * 3 * 2048 * 1408
    assert c.t(c.expert(1)) == pytest.approx(17_301_504 / A100_BW + 4 * LAUNCH)
    attn_bytes = (13_762_560 + 2 * 2048) * 2
    assert c.t(c.attention(1)) == pytest.approx(attn_bytes / A100_BW + 12 * LAUNCH)
    assert c.h2d() == pytest.approx(10e-6 + 17_301_504 / 24e9)
    assert c.t(c.dense_mlp(1)) == pytest.approx(3 * 2048 * 10944 * 2 / A100_BW + 5 * LAUNCH)


def test_qwen_layer_by_hand():
    c = cost_model("qwen15moe", "a100_40gb_pcie4")
    assert c.s.attn_params == 4 * 2048 * 2048
    assert c.s.shared_params == 3 * 2048 * 5632 + 2048
    assert c.s.moe_layers == 24 and c.s.num_experts == 60 and c.s.top_k == 4
    assert c.t(c.shared(1)) == pytest.approx(34_605_056 * 2 / A100_BW + 5 * LAUNCH)
    assert c.t(c.router(1)) == pytest.approx(2048 * 60 * 2 / A100_BW + 3 * LAUNCH)


def test_phi_layer_by_hand():
    c = cost_model("phi35moe", "a100_40gb_pcie4")
    assert c.s.attn_params == 2 * 4096 * 4096 + 2 * 4096 * 8 * 128
    assert c.expert_bytes() == 3 * 4096 * 6400 * 2 == 157_286_400
    assert c.s.shared_params == 0 and c.t(c.shared(1)) == 0.0
    assert c.h2d() == pytest.approx(10e-6 + 157_286_400 / 24e9)
    # INT4 draft experts: a quarter of the bytes plus one FP16 scale per 128 weights; one fused launch
    p = 3 * 4096 * 6400
    assert c.t(c.draft_experts(2), int4=True) == pytest.approx(2 * (p / 2 + p / 128 * 2) / A100_BW + LAUNCH)
    assert c.t(c.draft_experts(2, fused=False), int4=True) == pytest.approx(2 * (p / 2 + p / 128 * 2) / A100_BW
                                                                            + 8 * LAUNCH)


def test_compute_bound_at_many_tokens():
    c = cost_model("phi35moe", "a100_40gb_pcie4")
    op = c.expert(4096)
    assert c.t(op) == pytest.approx(op.flops / 312e12 + 4 * LAUNCH)


def test_device_files_state_sources():
    for name in ("a100_40gb_pcie4", "h200_pcie5"):
        d = load_device(name)
        assert all(d.sources.values()), d.sources
    assert load_device("h200_pcie5").h2d_bandwidth > load_device("a100_40gb_pcie4").h2d_bandwidth
    with pytest.raises(FileNotFoundError, match="known devices"):
        load_device("tpu")


def test_sensitivity_moves_the_right_way():
    rows = sensitivity("dsv2", "a100_40gb_pcie4", lambda c: c.h2d())
    h2d = [v for p, f, v in rows if p == "h2d_bandwidth"]
    assert h2d[0] > h2d[1] > h2d[2]  # more bandwidth, shorter copies
    hbm = [v for p, f, v in sensitivity("dsv2", "a100_40gb_pcie4", lambda c: c.target_step_resident())
           if p == "hbm_bandwidth"]
    assert hbm[0] > hbm[1] > hbm[2]


def test_report_csv_is_byte_identical_across_runs(tmp_path):
    from specter.projection.report import main, report_csv

    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert main([str(a)]) == 0 and main([str(b)]) == 0
    assert a.read_bytes() == b.read_bytes() == report_csv().encode()
    assert "target_only_tpot" in a.read_text()
