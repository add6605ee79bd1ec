import pytest

from specter.projection.cost_model import cost_model
from specter.projection.simulate import offload_ar, target_only


def test_all_hits_equals_resident_step():
    cm = cost_model("qwen15moe", "a100_40gb_pcie4")
    routes = [{layer: [0, 1, 2, 3] for layer in range(24)}] * 3  # experts 0..M-1 start resident
    out = offload_ar(cm, routes, resident=8)
    assert out["misses_per_token"] == 0
    assert out["tpot"] == pytest.approx(target_only(cm, 1))


def test_misses_cost_copies_and_lru_keeps_reused_experts():
    cm = cost_model("dsv2", "a100_40gb_pcie4")
    cold = [{layer: [40, 41, 42, 43, 44, 45] for layer in range(26)}]
    once = offload_ar(cm, cold, resident=16)
    assert once["misses_per_token"] == 6 * 26
    # each layer: 6 serial copies from the router's sync; each expert computes as it lands, under the
    # next copy (max, not sum), so only the last expert's compute adds to the copies
    dense0 = cm.dense_only_layer(1)  # layer 0: attention + its dense MLP (3*2048*10944)
    per_layer = cm.dense_layer(1) + 6 * cm.h2d() + cm.t(cm.expert(1))
    assert once["tpot"] == pytest.approx(dense0 + 26 * per_layer + cm.t(cm.lm_head(1)))
    twice = offload_ar(cm, cold * 2, resident=16)
    assert twice["misses_per_token"] == 6 * 26 / 2  # the second token hits what the first loaded


def test_too_few_slots_is_one_clear_error():
    cm = cost_model("dsv2", "a100_40gb_pcie4")
    with pytest.raises(RuntimeError, match="protected"):
        offload_ar(cm, [{0: [10, 11, 12, 13, 14, 15]}], resident=4)


def test_staging_buffers_let_fewer_slots_than_top_k_decode():
    cm = cost_model("dsv2", "a100_40gb_pcie4")
    routes = [{layer: [10, 11, 12, 13, 14, 15] for layer in range(26)}, {layer: [10, 11, 12, 13, 14, 15] for layer in range(26)}]
    with pytest.raises(RuntimeError, match="protected"):
        offload_ar(cm, routes, resident=4, staging=1)  # 4 own + 1 borrowed < 6
    out = offload_ar(cm, routes, resident=4, staging=2)
    # token 1: 6 misses per layer, 2 of them staged; after the layer 4 stay resident (its LRU evicted)
    # token 2: the 4 most recent (12..15) hit, 10 and 11 miss again, both staged
    assert out["staged_per_token"] == 2 * 26 and out["misses_per_token"] == (6 + 2) * 26 / 2
    assert out["tpot"] > offload_ar(cm, routes, resident=16)["tpot"]
