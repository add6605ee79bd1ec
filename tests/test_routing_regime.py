"""Every run says its routing regime: the cache's demand hit rate, the distinct experts per window
(from the routes the target really took) against independent routing, and the model's routing facts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import compose

from specter.assembly.methods import build_method
from specter.experiments.run import environment_of, model_routing
from specter.metrics import hit_rate, independent_working_set, step_windows, window_routing
from specter.moe import RouteLog

LINK = ["hardware=emulated", "hardware.bandwidth_gbps=2", "hardware.latency_us=5"]
PROMPT = torch.tensor([[17, 300, 45, 8, 512, 9, 77]])
N = 20


@pytest.mark.parametrize("E,k,n,expected", [(64, 6, 17, 52.0), (60, 4, 9, 27.8), (16, 2, 17, 14.3)])
def test_independent_working_set_by_hand(E, k, n, expected):
    assert round(independent_working_set(E, k, n), 1) == expected


def test_independent_working_set_limits():
    assert independent_working_set(64, 6, 1) == pytest.approx(6.0)  # one token: its k experts
    assert independent_working_set(64, 6, 0) == 0.0
    assert independent_working_set(16, 2, 10_000) == pytest.approx(16.0)  # many tokens: every expert


def test_hit_rate():
    assert hit_rate(3, 1) == 0.75 and hit_rate(0, 5) == 0.0 and hit_rate(0, 0) is None


def test_window_routing_counts_the_logged_routes():
    log = RouteLog()
    log.begin_window()  # window 0: two tokens, top-2 of 8, on layers 1 and 2
    log.add(1, torch.tensor([[0, 1], [0, 2]]))
    log.add(2, torch.tensor([[3, 4], [3, 4]]))
    log.begin_window()  # window 1: one token on each layer; a filter kept one route of layer 2's two
    log.add(1, torch.tensor([[5, 6]]))
    log.add(2, torch.tensor([3]), tokens=1)
    assert log.tokens == [{1: 2, 2: 2}, {1: 1, 2: 1}]
    per_window = window_routing(log, [[0], [1]], [1, 2], num_experts=8, top_k=2)
    ind2, ind1 = independent_working_set(8, 2, 2), independent_working_set(8, 2, 1)
    assert per_window["window_experts"] == pytest.approx((3 + 2 + 2 + 1) / 4)
    assert per_window["window_experts_vs_independent"] == pytest.approx((3 / ind2 + 2 / ind2 + 2 / ind1 + 1 / ind1) / 4)
    merged = window_routing(log, [[0, 1]], [1, 2], num_experts=8, top_k=2)  # one window of 3 tokens
    ind3 = independent_working_set(8, 2, 3)
    assert merged["window_experts"] == pytest.approx((5 + 2) / 2)
    assert merged["window_experts_vs_independent"] == pytest.approx((5 / ind3 + 2 / ind3) / 2)
    assert window_routing(log, [], [1, 2], 8, 2) == {"window_experts": None, "window_experts_vs_independent": None}


def test_step_windows_groups_consecutive_steps():
    assert step_windows(1, 8, 3) == [[1, 2, 3], [4, 5, 6], [7]]
    assert step_windows(1, 1, 3) == []
    assert step_windows(1, 3, 0) == [[1], [2]]


def _union(log: RouteLog, group: list[int], layer: int) -> set[int]:
    return set().union(*(log.windows[w].get(layer, ()) for w in group))


def _expected(log: RouteLog, groups: list[list[int]], layers: list[int], E: int, k: int) -> tuple[float, float]:
    sizes = [len(_union(log, g, layer)) for g in groups for layer in layers]
    ratios = [len(_union(log, g, layer)) / independent_working_set(E, k, sum(log.tokens[w][layer] for w in g))
              for g in groups for layer in layers]
    return sum(sizes) / len(sizes), sum(ratios) / len(ratios)


@pytest.mark.parametrize("method,extra", [("offload_ar", []), ("specter", ["method.quant=rtn", "K=4"])])
def test_generation_stats_come_from_the_route_log(method, extra, tiny_checkpoint):
    """Autoregressive windows are K+1 consecutive decode steps (the model's K), speculative ones the
    verification passes; both recomputed here from the engine's own route log."""
    ck = tiny_checkpoint("tiny_dsv2")
    cfg = compose(["model=tiny_dsv2", "memory=low", f"method={method}", *LINK, f"max_new_tokens={N}", *extra])
    m = build_method(cfg, ck)
    try:
        gen = m.generate(PROMPT, N, torch.Generator().manual_seed(0))
        om = m.rt.om
        if method == "offload_ar":
            log = m.route_log
            assert m.window_tokens == cfg.model.K + 1 and m.environment()["routing_window_tokens"] == m.window_tokens
            assert len(log.windows) == N and all(sum(t.values()) == len(om.moe_layers) for t in log.tokens[1:])
            groups = [list(range(i, min(i + m.window_tokens, N))) for i in range(1, N, m.window_tokens)]
        else:
            log = m.engine.route_log
            groups = [[w] for w in m.engine.recorder.verify_windows]
            assert all(log.tokens[w][om.moe_layers[0]] <= 5 for w in m.engine.recorder.verify_windows)  # Kb+1 <= K+1
        size, ratio = _expected(log, groups, om.moe_layers, om.num_experts, om.top_k)
        s = gen.stats
        assert s["window_experts"] == pytest.approx(size) and s["window_experts_vs_independent"] == pytest.approx(ratio)
        assert 0 < s["window_experts_vs_independent"] <= 1.5 and om.top_k <= s["window_experts"] <= om.num_experts
        assert s["hit_rate"] == pytest.approx(s["demand_hits"] / (s["demand_hits"] + s["demand_misses"]))
        assert 0 <= s["hit_rate"] <= 1
    finally:
        m.close()


ROUTING = {"text": "the stdlib sample", "tokens": 4096, "dead_experts": [0, 3], "usage_entropy": [3.9, 3.7]}


@pytest.mark.parametrize("report,expected", [
    (None, None),  # no report file
    ("not json", None),
    ({"steps": 10}, None),  # a report without the routing entry
    ({"routing": "oops"}, None),
    ({"routing": ROUTING}, ROUTING),
    ({"routing": {"tokens": True, "dead_experts": [1, "x"], "usage_entropy": [2]}},
     {"text": None, "tokens": None, "dead_experts": None, "usage_entropy": [2.0]}),
])
def test_model_routing_is_read_defensively(report, expected, tmp_path):
    if report is not None:
        (tmp_path / "specter_trained.json").write_text(report if isinstance(report, str) else json.dumps(report))
    assert model_routing(tmp_path) == expected
    assert model_routing(tmp_path / "missing") is None


def test_env_names_the_model_routing(tmp_path):
    stub = SimpleNamespace(final_spec=lambda: SimpleNamespace(record=lambda: {}), environment=lambda: {})
    assert environment_of(stub, tmp_path, "d")["model_routing"] is None
    (tmp_path / "specter_trained.json").write_text(json.dumps({"routing": ROUTING}))
    assert environment_of(stub, tmp_path, "d")["model_routing"] == ROUTING
