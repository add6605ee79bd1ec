"""Offloading baselines on the shared runtime: mo_sc, mo_sm, specmoeoff (lossless), moe_spec (lossy).

Greedy output of the lossless baselines equals target-only decoding on every tiny architecture
and tier; budgets are the same accounting as Specter's; the staging buffers are real device
buffers; MoE-Spec with an unbinding budget is Specter exactly and a small one loads less.
"""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES, TINY_MODELS, compose

from baselines.moe_spec import ExpertBudget
from specter.assembly.config import ConfigError
from specter.assembly.methods import build_method
from specter.records.records import COLUMNS
from specter.kernels.reference import moe_reference
from specter.models.loading import load_full_model
from specter.moe import SpecterExperts
from specter.offload import ExpertCache, ExpertLayout, ExpertUID, HostExpertStore, ImmediateLink
from specter.offload.budget import BudgetError
from specter.offload.residency import expert_wise_moe
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams

CPU = torch.device("cpu")
# memory.slots=budget: these tests check each method's own sizing rule against the tiny tier's bytes (the rule the
# real model's plan applies at real sizes; tests/test_calibrated_machine.py checks the plan's slots on tiny models)
LINK = ["hardware=emulated", "hardware.bandwidth_gbps=2", "hardware.latency_us=5", "memory.slots=budget"]
PROMPTS = (torch.tensor([[17, 300, 45, 8, 512, 9, 77]]), torch.tensor([[3]]))
N = 20


def _cfg(model, memory, method, *extra):
    return compose([f"model={model}", f"memory={memory}", f"method={method}", *LINK, f"max_new_tokens={N}", *extra])


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Greedy target-only continuations (the plain transformers model), per (model, prompt)."""
    cache = {}

    def get(model, i):
        if (model, i) not in cache:
            full = load_full_model(tiny_checkpoint(model), torch.float32, CPU)
            cache[(model, i)] = generate_autoregressive(full, PROMPTS[i], N, SamplingParams())
        return cache[(model, i)]

    return get


# ------------------------------------------------------------------------------------ lossless
@pytest.mark.parametrize("method", ["mo_sc", "mo_sm", "specmoeoff"])
@pytest.mark.parametrize("memory", ["high", "low"])
@pytest.mark.parametrize("model", TINY_MODELS)
def test_greedy_baselines_equal_target_only(method, memory, model, tiny_checkpoint, reference):
    extra = ["method.quant=rtn"] if method == "specmoeoff" else []
    m = build_method(_cfg(model, memory, method, *extra), tiny_checkpoint(model))
    try:
        for i, prompt in enumerate(PROMPTS):
            m.reset()
            gen = m.generate(prompt, N, torch.Generator().manual_seed(0))
            assert gen.tokens == reference(model, i), f"prompt {i}"
            assert gen.clock.num_tokens == N and gen.stats["h2d_bytes"] > 0
            assert gen.stats["oracle_h2d_bytes"] <= gen.stats["h2d_bytes"]
            if method == "specmoeoff":
                assert gen.stats["drafted_tokens"] > 0 and gen.stats["mean_accepted_len"] >= 1
        assert m.rt.footprint.total <= m.rt.budget_bytes
    finally:
        m.close()


# ------------------------------------------------------------------------------------ staging buffers
def _store(E: int, layers: list[int], H: int = 8, I: int = 4) -> HostExpertStore:
    store = HostExpertStore(ExpertLayout(H, I, torch.float32), layers, E, pin_memory=False)
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        for e in range(E):
            store.write(ExpertUID(layer, e), torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g))
    return store


def _slots_hold_their_experts(cache: ExpertCache) -> None:
    for layer in cache.layers:
        cache.wait_resident(layer)
        for expert in cache.resident(layer):
            slot = cache.slot_of(layer, expert)
            assert torch.equal(cache.slot_buffer(layer, slot), cache.store.buffer(ExpertUID(layer, expert)))


def test_staging_buffers_hold_loads_while_every_slot_is_in_use():
    store = _store(6, [1, 2])
    plain = ExpertCache(store, ImmediateLink(), {1: 1, 2: 1}, CPU, torch.float32)
    staged = ExpertCache(store, ImmediateLink(), {1: 1, 2: 1}, CPU, torch.float32, staging=2)
    assert staged.device_bytes() == plain.device_bytes() + 2 * store.nbytes_per_expert
    held = [plain.acquire(ExpertUID(1, 3))]
    assert plain.acquire(ExpertUID(1, 4)) is None  # no staging: the layer must wait for a release
    held = [staged.acquire(ExpertUID(1, e)) for e in (3, 4, 5)]  # 1 slot + 2 borrowed buffers
    assert all(h is not None for h in held) and staged.counters.staged_loads == 2
    held.append(staged.acquire(ExpertUID(2, 0)))  # layer 2's own slot in use too
    assert staged.acquire(ExpertUID(2, 1)) is None  # the pool is shared: layer 2 finds it empty
    for h in held:
        assert torch.equal(torch.cat([v.flatten() for v in staged.views(h)]), store.buffer(h.uid))
        staged.release(h)
    assert staged.resident(1) == {5} and staged.capacity(1) == 1  # back to M, the most recent one kept
    assert staged.free_staging() == 2 and staged.resident(2) == {0}
    _slots_hold_their_experts(staged)


def test_staging_buffers_under_random_traffic():
    """Buffers move between layers; every slot always holds its expert's bytes; reset restores all."""
    store = _store(6, [1, 2])
    cache = ExpertCache(store, ImmediateLink(), {1: 2, 2: 1}, CPU, torch.float32, staging=2)
    rng = random.Random(0)
    held = []
    for _ in range(400):
        layer, e = rng.choice([1, 2]), rng.randrange(6)
        if rng.random() < 0.55:
            h = cache.acquire(ExpertUID(layer, e))
            if h is None:
                assert cache.free_staging() == 0 and cache.protected_count(layer) == len(cache.resident(layer))
            else:
                held.append(h)
        elif held:
            cache.release(held.pop(rng.randrange(len(held))))
        borrowed = sum(len(cache.resident(lay)) - cache.capacity(lay) for lay in cache.layers)
        assert borrowed + cache.free_staging() == 2  # every staging buffer is lent or in the pool
        for h in held:
            assert torch.equal(torch.cat([v.flatten() for v in cache.views(h)]), store.buffer(h.uid))
        _slots_hold_their_experts(cache)
    for h in held:
        cache.release(h)
    assert all(len(cache.resident(lay)) == cache.capacity(lay) for lay in cache.layers)
    cache.reset()
    _slots_hold_their_experts(cache)
    assert cache.free_staging() == 2 and cache.resident(1) == {0, 1}


def test_expert_wise_moe_with_staging_equals_reference():
    E, H, I = 8, 8, 4
    store = _store(E, [1], H, I)
    gate_up = torch.stack([store.views(ExpertUID(1, e))[0] for e in range(E)])  # [E, 2I, H]
    down = torch.stack([store.views(ExpertUID(1, e))[1] for e in range(E)])  # [E, H, I]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=g)  # [T, H]
    idx = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(5)])  # [T, k]
    w = torch.softmax(torch.randn(5, 3, generator=g), -1)  # [T, k]
    cache = ExpertCache(store, ImmediateLink(), {1: 2}, CPU, torch.float32, staging=4)
    out = expert_wise_moe(x, idx, w, 1, cache, F.silu)
    torch.testing.assert_close(out, moe_reference(x, idx, w, gate_up, down, F.silu), rtol=0, atol=0)
    assert cache.counters.staged_loads > 0 and len(cache.resident(1)) == 2


# ------------------------------------------------------------------------------------ budgets
def test_mo_sc_counts_staging_and_obeys_the_budget(tiny_checkpoint):
    m = build_method(_cfg("tiny_qwen", "low", "mo_sc"), tiny_checkpoint("tiny_qwen"))
    try:
        L, eb = len(m.rt.om.moe_layers), m.rt.om.store.nbytes_per_expert
        fp = m.rt.footprint
        staging = min(round(1.2 * L), (m.rt.budget_bytes - (fp.total - fp.staging)) // eb)  # the one rule
        assert m.rt.resident == 8 and fp.cache_slots == 8 * L * eb and fp.staging == staging * eb == m.rt.cache.staging * eb
        total, design, n = fp.total, fp.total - fp.staging, m.rt.cache.staging
    finally:
        m.close()
    assert n > 0
    tight = build_method(_cfg("tiny_qwen", "low", "mo_sc", f"memory.budget_mb={(total - 1) / (1 << 20)}"),
                         tiny_checkpoint("tiny_qwen"))
    try:  # a byte less: one staging buffer fewer, never over the budget
        assert tight.rt.cache.staging == n - 1 and tight.rt.footprint.total <= total - 1
    finally:
        tight.close()
    too_small = (design - 1) / (1 << 20)
    with pytest.raises(BudgetError, match="mo_sc"):
        build_method(_cfg("tiny_qwen", "low", "mo_sc", f"memory.budget_mb={too_small}"), tiny_checkpoint("tiny_qwen"))


@pytest.mark.parametrize("memory", ["high", "low"])
def test_mo_sm_gets_specters_device_bytes(memory, tiny_checkpoint):
    """M' is the largest slot count whose footprint does not exceed Specter's real one at this tier."""
    ck = tiny_checkpoint("tiny_dsv2")
    spec = build_method(_cfg("tiny_dsv2", memory, "specter", "method.quant=rtn"), ck)
    specter_total = spec.rt.footprint.total
    spec.close()
    m = build_method(_cfg("tiny_dsv2", memory, "mo_sm"), ck)
    try:
        d = m.environment()["same_memory_derivation"]
        assert d["specter_footprint"]["total"] == specter_total  # the same accounting as the budget check
        row = len(m.rt.om.moe_layers) * m.rt.om.store.nbytes_per_expert
        assert m.rt.footprint.total <= specter_total < m.rt.footprint.total + row
        assert m.rt.resident == d["resident"] > spec.rt.resident and d["used"]["from"] == "derived"
        assert m.static_fields()["resident_experts"] == m.rt.resident
    finally:
        m.close()


def test_specmoeoff_draft_is_separate_and_paid_for(tiny_checkpoint):
    m = build_method(_cfg("tiny_phi", "high", "specmoeoff", "method.quant=rtn"), tiny_checkpoint("tiny_phi"))
    try:
        target = {t.data_ptr() for t in [*m.rt.model.parameters(), *m.rt.model.buffers()]}
        draft = [t.data_ptr() for t in m.draft_model.parameters()]
        assert draft and not target & set(draft)  # no tensor shared with the target
        experts = [mod for mod in m.draft_model.modules() if isinstance(mod, SpecterExperts)]
        assert experts and all(mod.runtime is m.draft_moe is not m.rt.moe for mod in experts)
        env = m.environment()
        assert env["separate_draft_bytes"]["non_expert"] == m.rt.footprint.non_expert
        fp, sep = m.rt.footprint, env["separate_draft_bytes"]
        assert (fp.draft_experts, fp.draft_non_expert) == (m.draft_bytes, sep["non_expert"])  # each in its column
        assert fp.kv_cache == 2 * sep["kv_cache"] and fp.scratch == 2 * sep["scratch"]  # the draft's beside the target's
        # as designed: every slot the budget holds beside the draft (the artifact's 12 of 16 do not fit)
        assert m.rt.resident == env["residents"]["used"] == env["residents"]["fit_in_budget"] < 12
        assert m.rt.footprint.total <= m.rt.budget_bytes
        assert m.static_fields()["K"] == 3 and env["prefetch_steps"] == [1]  # int(0.6) = 0 has no routes yet
        gen = m.generate(PROMPTS[0], 12, torch.Generator().manual_seed(0))
        assert gen.stats["prefetch_recall"] is not None  # the route-frequency plan was scored
        assert m.engine.drafter.kv.columns <= PROMPTS[0].shape[1] + 12  # its own KV, rolled back
    finally:
        m.close()


# ------------------------------------------------------------------------------------ moe_spec
def test_expert_budget_truncate_and_substitute_by_hand():
    E = 6
    idx = torch.tensor([[0, 1], [0, 2], [3, 1]])  # [T, k]
    w = torch.tensor([[0.5, 0.3], [0.4, 0.4], [0.1, 0.2]])  # [T, k]
    probs = torch.zeros(3, E).scatter_(1, idx, w)  # [T, E]; summed: e0 .9, e1 .5, e2 .4, e3 .1
    same = ExpertBudget(4, "truncate", E)(0, idx, w, probs)
    assert same[0] is idx and same[1] is w  # every routed expert is in the top 4: untouched
    t_idx, t_w = ExpertBudget(2, "truncate", E)(0, idx, w, probs)  # keep e0, e1
    assert t_idx.tolist() == [[0, 1], [0, E], [E, 1]]
    torch.testing.assert_close(t_w, torch.tensor([[0.5, 0.3], [0.8, 0.0], [0.0, 0.3]]))  # token totals kept
    s_idx, s_w = ExpertBudget(2, "substitute", E)(0, idx, w, probs)
    assert s_idx.tolist() == [[0, 1], [0, 1], [0, 1]]  # each dropped route -> best kept one not yet used
    torch.testing.assert_close(s_w, w)
    s_idx, s_w = ExpertBudget(1, "substitute", E)(0, idx, w, probs)  # only e0 kept
    assert s_idx.tolist() == [[0, E], [0, E], [0, E]] and s_w[:, 1].tolist() == [0, 0, 0] and s_w[2, 0] == 0.1


def test_expert_budget_ranks_by_the_full_softmax_over_every_token():
    """MoE-Spec's Algorithm 1: score_e = Σ_t softmax(logits_t)_e, not the selected top-k weights.
    Here no token selects e1, yet it carries the most probability mass, so a budget of 1 keeps it."""
    E = 4
    probs = torch.tensor([[0.50, 0.45, 0.05, 0.00], [0.00, 0.45, 0.55, 0.00]])  # [T, E]
    w, idx = probs.topk(1, dim=-1)  # [T, 1]: token 0 -> e0, token 1 -> e2; summed top-k weights rank e2 first
    budget = ExpertBudget(1, "substitute", E)
    assert budget.ranking(probs).tolist() == [1]
    s_idx, s_w = budget(0, idx, w, probs)
    assert s_idx.tolist() == [[1], [1]] and torch.equal(s_w, w)
    logits = torch.log(probs.clamp_min(1e-9))  # the router's logits, as the forward hook records them
    budget.router_logits[0] = logits
    assert budget(0, idx, w)[0].tolist() == [[1], [1]]


def test_moe_spec_budget_reaches_the_planner(tiny_checkpoint):
    """The plan of every window keeps at most B experts per layer (the budget caps the plan's capacity)."""
    m = build_method(_cfg("tiny_dsv2", "low", "moe_spec", "method.quant=rtn", "K=8", "method.budget=1"),
                     tiny_checkpoint("tiny_dsv2"))
    try:
        assert m.rt.cache.staging > 0 or m.rt.resident > 1  # uncapped, the plan would keep more than one
        assert set(m.engine.plan_capacity.values()) == {1}
        claimed = []
        planner = m.engine.planner
        on_boundary = planner.on_boundary

        def spy(step, plan, resident, pending, capacity):
            decision = on_boundary(step, plan, resident, pending, capacity)
            claimed.append(max(len(c) for c in planner.claimed.values()))
            assert all(len(experts) <= 1 for experts in plan.values()) and set(capacity.values()) == {1}
            return decision

        planner.on_boundary = spy
        m.generate(PROMPTS[0], N, torch.Generator().manual_seed(0))
        assert claimed and max(claimed) == 1
    finally:
        m.close()


def test_moe_spec_unbinding_budget_is_specter_and_a_small_one_loads_less(tiny_checkpoint):
    ck = tiny_checkpoint("tiny_dsv2")
    prompt = PROMPTS[0]
    runs = {}
    # MoE-Spec keeps the LRU cache of its design: it is compared with Specter at method.residency=lru
    for name, extra in [("specter", []), ("full", ["method.budget=64"]), ("small", ["method.budget=3"])]:
        m = build_method(_cfg("tiny_dsv2", "low", "moe_spec" if extra else "specter", "method.quant=rtn", "K=8",
                              *(extra or ["method.residency=lru"])), ck)
        try:
            gen = m.generate(prompt, N, torch.Generator().manual_seed(0))
            windows = m.engine.route_log.windows
            runs[name] = (gen, windows, m)
            if name == "full":  # the target's NLL of the tokens, from the plain transformers model
                full = load_full_model(ck, torch.float32, CPU)
                ids = torch.cat([prompt[0], torch.tensor(gen.tokens[:-1])])[None]
                with torch.inference_mode():
                    logits = full(input_ids=ids).logits
                logp = F.log_softmax(logits[0, prompt.shape[1] - 1:].float(), -1)
                nll = -logp.gather(1, torch.tensor(gen.tokens)[:, None]).mean()
                assert gen.stats["target_nll"] == pytest.approx(float(nll), rel=1e-5)
        finally:
            m.close()
    spec, full, small = (runs[k][0] for k in ("specter", "full", "small"))
    assert full.tokens == spec.tokens
    for key in ("h2d_bytes", "demand_misses", "accepted_tokens", "drafted_tokens", "oracle_h2d_bytes"):
        assert full.stats[key] == spec.stats[key], key
    assert full.stats["first_divergence"] == N and full.stats["token_match_fraction"] == 1.0
    assert small.stats["h2d_bytes"] < spec.stats["h2d_bytes"]
    assert all(len(experts) <= 3 for w in runs["small"][1][1:] for experts in w.values())  # verifications
    assert max(len(e) for e in runs["small"][1][0].values()) > 3  # the prefill ran the full router
    assert 0 <= small.stats["first_divergence"] <= N and 0 <= small.stats["token_match_fraction"] <= 1
    assert runs["small"][2].static_fields()["expert_budget"] == 3


# ------------------------------------------------------------------------------------ run.py and errors
@pytest.mark.parametrize("method,extra", [
    ("mo_sc", []), ("mo_sm", []), ("specmoeoff", ["method.quant=rtn"]),
    ("moe_spec", ["method.quant=rtn", "method.budget_mode=truncate"])])
def test_run_writes_the_common_records(method, extra, tmp_path, tiny_checkpoint):
    from specter.experiments.run import run

    tiny_checkpoint("tiny_dsv2")
    out = run(compose(["model=tiny_dsv2", "memory=low", f"method={method}", *LINK, *extra, "num_prompts=1",
                       "max_new_tokens=6", "warmup_tokens=0", "progress=false", "dataset=humaneval",
                       f"assets_dir={FIXTURES / 'datasets'}", f"output_dir={tmp_path / 'o'}"]))
    rec = pd.read_csv(out / "records.csv")
    assert tuple(rec.columns) == COLUMNS and len(rec) == 1 and rec.new_tokens.eq(6).all()
    lossy = ["expert_budget", "budget_mode", "first_divergence", "token_match_fraction", "target_nll"]
    if method == "moe_spec":
        assert rec[lossy].notna().all(axis=None) and rec.budget_mode.eq("truncate").all()
        assert rec.expert_budget.eq(32).all()  # default: half the routed experts
    else:
        assert rec[lossy].isna().all(axis=None)
    assert rec.accepted_fraction.notna().all() == (method in ("specmoeoff", "moe_spec"))
    # the routing regime of every offloading method: cache hit rate, window working set vs independent routing
    assert rec.hit_rate.between(0, 1).all() and rec.window_experts.between(6, 64).all()
    assert (rec.window_experts_vs_independent > 0).all() and (rec.window_experts_vs_independent <= 1.5).all()
    summary = pd.read_csv(out / "summary.csv")
    assert summary.window_experts.iloc[0] == pytest.approx(rec.window_experts.mean())
    assert summary.hit_rate.iloc[0] == pytest.approx(rec.hit_rate.mean())
    assert json.loads((out / "env.json").read_text())["model_routing"] is None
    env = json.loads((out / "env.json").read_text())["method"]
    if method in ("mo_sc", "mo_sm"):  # autoregressive: windows of the model's K+1 target steps
        assert env["routing_window_tokens"] == 17
    if method == "mo_sm":
        assert rec.resident_experts.iloc[0] == env["same_memory_derivation"]["resident"] > 4
    if method in ("mo_sc", "mo_sm", "specmoeoff"):  # the rule of every cache-owning method
        assert env["staging_buffers"] == rec.staging_buffers.iloc[0] > 0
        assert env["footprint_bytes"]["total"] == rec.footprint_bytes.iloc[0] <= env["budget_bytes"]


@pytest.mark.parametrize("method,override,needle", [
    ("moe_spec", "method.budget=0", "method.budget"),
    ("moe_spec", "method.budget_mode=drop", "budget_mode"),
    ("moe_spec", "verify_lossless=true", "lossy"),
    ("mo_sc", "method.staging_buffers=-1", "staging_buffers"),
    ("specmoeoff", "method.prefetch_at=[1.5]", "prefetch_at"),
])
def test_bad_settings_are_one_line_config_errors(method, override, needle, tiny_checkpoint):
    with pytest.raises(ConfigError, match=needle) as err:
        build_method(_cfg("tiny_dsv2", "low", method, override), tiny_checkpoint("tiny_dsv2"))
    assert "\n" not in str(err.value)
