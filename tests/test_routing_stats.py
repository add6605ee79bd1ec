"""Routing statistics and the balance loss: hand-computed values, the gates rejecting the collapsed
routing the tiny models used to have and passing balanced routing, and the tool end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specter import routing_stats as rs
from specter.models.balance import RouterTap, expert_balance_loss, expert_balance_loss_reference

FIXTURES = Path(__file__).parent / "fixtures"


def test_usage_entropy_dead_experts_and_top8():
    routes = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # [N, k]; expert 0 carries half
    share = rs.usage_share(routes, 5)
    assert share.tolist() == pytest.approx([0.5, 0.25, 0.125, 0.125, 0.0])
    h = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 2 * 0.125 * math.log(0.125))
    assert rs.normalized_entropy(share) == pytest.approx(h / math.log(5))
    assert rs.normalized_entropy(torch.full((7,), 1 / 7)) == pytest.approx(1.0)


def test_windows_stay_inside_documents_and_working_sets_union_them():
    doc_a = torch.tensor([[0], [1], [2], [3], [4]])  # windows of 2: {0,1} {2,3}; the tail is dropped
    doc_b = torch.tensor([[5], [5]])
    sets = rs.windows([doc_a, doc_b], 2)
    assert sets == [{0, 1}, {2, 3}, {5}]
    assert rs.working_set(sets, 3) == 5.0  # every draw of 3 is all of them
    assert rs.working_set(sets, 1, samples=3000) == pytest.approx((2 + 2 + 1) / 3, abs=0.05)
    assert math.isnan(rs.working_set(sets, 4))


def test_lru_hit_rate_by_hand():
    # 2 slots: 0 miss, 1 miss, 0 hit, 2 miss (evicts 1), 1 miss (evicts 0), 2 hit -> 2 of 6
    routes = torch.tensor([[0], [1], [0], [2], [1], [2]])
    assert rs.lru_hit_rate(routes, 2) == pytest.approx(2 / 6)
    assert rs.lru_hit_rate(routes, 3) == pytest.approx(3 / 6)
    assert rs.lru_hit_rate(torch.tensor([[4, 4]]), 1) == 0.0  # a repeated id is one demand


def test_balance_loss_matches_a_hand_computation():
    logits = torch.log(torch.tensor([[1.0, 1, 2, 4], [1, 1, 2, 4]]))  # P = [1/8, 1/8, 2/8, 4/8]
    topk = torch.tensor([[3, 2], [3, 0]])  # counts [1, 0, 1, 2]; f = E / (k T) * counts = counts
    assert expert_balance_loss(logits, topk).item() == pytest.approx(1 / 8 + 2 / 8 + 2 * 4 / 8)
    uniform = torch.zeros(6, 4)
    assert expert_balance_loss(uniform, torch.tensor([[0], [1], [2], [3], [0], [1]])).item() == pytest.approx(1.0)


@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (5, 8, 2), (17, 64, 6), (9, 60, 4), (3, 16, 2)])
def test_balance_loss_matches_its_reference_and_pushes_load_off_busy_experts(T, E, k):
    g = torch.Generator().manual_seed(T * 100 + E)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    topk = logits.topk(k, dim=-1).indices
    fast, slow = expert_balance_loss(logits, topk), expert_balance_loss_reference(logits, topk)
    assert fast.item() == pytest.approx(slow.item(), rel=1e-5)
    fast.backward()
    counts = torch.bincount(topk.flatten(), minlength=E)
    busiest, idle = int(counts.argmax()), int(counts.argmin())
    # gradient descent lowers the busiest expert's logits more than an idle one's
    assert logits.grad[:, busiest].sum() > logits.grad[:, idle].sum()


def test_router_tap_collects_every_moe_layer_with_gradients():
    from specter.models import tiny
    from specter.models.balance import routers_of

    model = tiny.build_random_model("tiny_qwen").train()
    tap = RouterTap(routers_of(model))
    with tap.attached():
        model(input_ids=torch.arange(12)[None])
    assert sorted(tap.seen) == list(range(4))
    loss = tap.balance_loss()
    loss.backward()
    assert loss.item() >= 1.0 - 1e-6 and not tap.seen  # >= 1, equal only when balanced; read once
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def _fixture_report(name: str) -> dict:
    fx = json.loads((FIXTURES / name).read_text())
    routes = {int(layer): [torch.tensor(d) for d in docs] for layer, docs in fx["routes"].items()}
    return rs.summarize_routes(routes, fx["num_experts"], fx["top_k"], fx["model_type"], fx["K"] + 1,
                               {"low": 4, "high": 16}, fx["text"])


def test_the_collapsed_tiny_dsv2_routing_is_rejected():
    report = _fixture_report("routes_tiny_dsv2_collapsed.json")
    passed = report["gates"]["passed"]
    assert not passed["no_dead_expert"] and not passed["usage_entropy"] and not passed["window_vs_independent"]
    assert min(report["dead_experts"]) >= 20  # about half of the 64 experts never fire


@pytest.mark.parametrize("model_type,E,k,K", [("qwen2_moe", 60, 4, 8), ("deepseek_v2", 64, 6, 16), ("phimoe", 16, 2, 16)])
def test_independent_uniform_routing_passes(model_type, E, k, K):
    g = torch.Generator().manual_seed(E)
    docs = [torch.rand(128, E, generator=g).topk(k, dim=-1).indices for _ in range(24)]  # [N_d, k] each
    report = rs.summarize_routes({1: docs, 2: docs}, E, k, model_type, K + 1, {"low": 4}, "synthetic")
    assert all(report["gates"]["passed"].values()), report["gates"]
    assert report["layers"][0]["window_vs_independent"] == pytest.approx(1.0, abs=0.05)


def test_the_tool_writes_its_files_and_refuses_what_it_cannot_read(tmp_path, tiny_checkpoint, capsys):
    tiny_checkpoint("tiny_qwen")  # the random checkpoint, built once
    out = tmp_path / "out"
    assert rs.main(["tiny_qwen", "--untrained", "--tokens", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "routing gates:" in printed and "LRU high" in printed
    for f in ("routing.json", "layers.csv", "working_set.csv", "routing.png"):
        assert (out / f).stat().st_size > 0
    report = json.loads((out / "routing.json").read_text())
    assert report["tokens"] == 256 and len(report["layers"]) == 4 and report["window_tokens"] == 9
    assert rs.main([str(tmp_path / "nothing-here"), "--out", str(out)]) == 2
    assert "neither a tiny model" in capsys.readouterr().err
    assert rs.main(["tiny_qwen", "--K", "0"]) == 2  # one line, not argparse's usage and exit


@pytest.mark.parametrize("name,overrides", [
    ("tiny_dsv2", dict(n_routed_experts=24, num_experts_per_tok=3, norm_topk_prob=True, q_lora_rank=None,
                       moe_intermediate_size=64)),
    ("tiny_qwen", dict(num_experts=12, num_experts_per_tok=2, norm_topk_prob=True, hidden_size=64)),
])
def test_an_unseen_checkpoint_folder_is_measured_with_its_own_sizes(tmp_path, tiny_checkpoint, capsys, name, overrides):
    """Other expert counts, top-k, widths, norm_topk_prob and no q_lora: read from the checkpoint, not assumed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specter.models import tiny
    from specter.models.balance import RouterTap, routers_of

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.make_config(name, **overrides), dtype=torch.float32)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_checkpoint(name)).save_pretrained(folder)
    assert rs.main([str(folder), "--tokens", "128", "--K", "4", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "routing.json").read_text())
    E, k = overrides.get("n_routed_experts", overrides.get("num_experts")), overrides["num_experts_per_tok"]
    assert report["num_experts"] == E and report["top_k"] == k and report["window_tokens"] == 5
    assert len(report["sorted_share"]["1"]) == E
    tap = RouterTap(routers_of(model.train()))
    with tap.attached():
        model(input_ids=torch.arange(10)[None])
    assert tap.balance_loss().item() >= 1.0 - 1e-6
