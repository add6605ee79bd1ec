"""Batched decoding: every request's greedy output equals its own B=1 output; KV rollback per request;
one expert load per step serves the whole batch; requests join and leave; experiment=batch writes its files."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pandas as pd
import pytest
import torch
from conftest import FIXTURES, TINY_MODELS, compose
from transformers import DynamicCache

from specter.assembly.sizing import footprint_at
from specter.assembly.methods import build_method
from specter.models.loading import load_full_model
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.batch_state import BatchKV
from specter.speculative.batched import (
    BatchedAutoregressive,
    greedy_verify_batch,
    padding_filter,
)
from specter.speculative.engine import SpeculativeEngine
from specter.speculative.sampling import SamplingParams, greedy_verify

CPU = torch.device("cpu")
GREEDY = SamplingParams()
PROMPT_LENS = (1, 16, 5, 9, 3, 12, 7, 2)  # mixed lengths: every batch is padded
NEW = 24


def _cfg(name, memory, *extra):
    return compose([f"model={name}", f"memory={memory}", "method=specter", "method.quant=rtn", "hardware=emulated",
                    "hardware.bandwidth_gbps=20", "hardware.latency_us=5", *extra])


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1000, (1, n), generator=g) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference():
    """Greedy target-only continuation of a prompt on the plain transformers model (the B=1 output)."""
    models, cache = {}, {}

    def get(name, ck, prompt, n=NEW):
        key = (name, tuple(prompt.reshape(-1).tolist()), n)
        if key not in cache:
            if name not in models:
                models[name] = load_full_model(ck, torch.float32, CPU)
            cache[key] = generate_autoregressive(models[name], prompt.reshape(1, -1), n, GREEDY)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------- exact greedy equality
@pytest.mark.parametrize("memory", ["high", "low"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_batched_specter_equals_b1_greedy(name, memory, tiny_checkpoint, reference):
    ck = tiny_checkpoint(name)
    method = build_method(_cfg(name, memory, "K=4"), ck)
    prompts = _prompts()
    n = 16
    refs = [reference(name, ck, p, n) for p in prompts]
    cache, acquire = method.rt.cache, method.rt.cache.acquire
    misses: dict[tuple, int] = defaultdict(int)  # (target pass, layer, expert) -> demand loads

    def logged(uid, *, demand=True):
        handle = acquire(uid, demand=demand)
        if handle is not None and not handle.hit:
            misses[(len(engine.route_log.windows), uid.layer, uid.expert)] += 1
        return handle

    cache.acquire = logged
    try:
        engine = method.make_engine()
        for B in (1, 2, 3, 8):
            method.reset()
            misses.clear()
            run = engine.generate_batch(prompts[:B], n)
            assert run.tokens == refs[:B], f"B={B}"
            assert max(misses.values(), default=1) == 1  # one load per expert per pass serves all B requests
            for req in run.requests:
                assert req.clock.num_tokens == n and sum(req.accepted) <= sum(req.drafted)
                assert 0 <= req.stats["accepted_fraction"] <= 1
            assert run.stats["iterations"] >= 1 and run.stats["distinct_experts_per_layer"] > 0
            assert engine.kv.batch_size == 0  # every request left the batch
    finally:
        cache.acquire = acquire
        method.close()


@pytest.mark.parametrize("microbatches", [2, 3])
def test_microbatches_share_one_cache_and_equal_b1_greedy(microbatches, tiny_checkpoint, reference):
    """Any number of microbatches over one runtime: each request's tokens are its B=1 greedy output,
    and the I/O is the shared cache's (one count for the whole batch, not one per microbatch)."""
    from specter.speculative.engine import generate_microbatched

    name = "tiny_dsv2"
    ck = tiny_checkpoint(name)
    method = build_method(_cfg(name, "low", "K=4"), ck)
    prompts = _prompts()[:5]
    try:
        engines = [method.make_engine() for _ in range(microbatches)]
        method.reset()
        run = generate_microbatched(engines, prompts, 12)
        assert run.tokens == [reference(name, ck, p, 12) for p in prompts]
        assert [len(e.submitted) for e in engines] == ([3, 2] if microbatches == 2 else [2, 2, 1])
        assert run.stats["h2d_bytes"] == method.rt.cache.counters.loads * method.rt.om.store.nbytes_per_expert
        assert run.stats["oracle_h2d_bytes"] <= run.stats["h2d_bytes"]
    finally:
        method.close()


def _corrupt_draft_of(moe) -> None:
    """A much worse draft (per-token scaled expert outputs): requests reject at different positions."""
    inner = moe.draft.forward

    def noisy(x, idx, w, d, act):
        scale = 1 + 4 * torch.sin(torch.arange(x.shape[0], dtype=x.dtype) * 1.7 + x[:, 0].sign())[:, None]
        return inner(x, idx, w, d, act) * scale

    moe.draft = replace(moe.draft, forward=noisy)


@pytest.mark.parametrize(("name", "max_holes"), [("tiny_dsv2", 0), ("tiny_phi", 6)])  # MLA and GQA caches
def test_rollback_with_uneven_acceptance(name, max_holes, tiny_checkpoint, reference):
    """With a bad draft each request accepts a different number of tokens per window; per-request
    rollback (compaction, or masked holes kept up to `max_holes` columns) keeps every output exact."""
    ck = tiny_checkpoint(name)
    method = build_method(_cfg(name, "low", "K=4"), ck)
    _corrupt_draft_of(method.rt.moe)
    prompts = _prompts(1)[:5]
    try:
        m = method.cfg.method
        engine = SpeculativeEngine(method.rt, 4, GREEDY, prefetch=m.prefetch, max_holes=max_holes)
        run = engine.generate_batch(prompts, NEW)
        assert run.tokens == [reference(name, ck, p) for p in prompts]
        rates = {round(r.stats["accepted_fraction"], 3) for r in run.requests}
        assert len(rates) > 1 and min(rates) < 1  # acceptance really differed across requests
        assert run.stats["kv_compactions"] >= 1
    finally:
        method.close()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_batch_kv_keeps_each_request_cache(name, tiny_checkpoint):
    """After draft scratch, verification and uneven commits, each row's valid columns are its own
    B=1 cache, and the next batched forward gives each request its B=1 logits."""
    model = load_full_model(tiny_checkpoint(name), torch.float32, CPU)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 1000, (n,), generator=g) for n in (4, 11, 1)]
    with torch.inference_mode():
        for max_holes in (0, 100):
            seqs = [p.tolist() for p in prompts]  # committed tokens per request (KV cached for all)
            kv = BatchKV(model, CPU, max_holes=max_holes)
            ids, token_valid = kv.prefill_inputs(prompts, pad_id=1)
            assert token_valid is not None and int(token_valid.sum()) == sum(p.numel() for p in prompts)
            kv.run(ids)
            assert kv.pending == 0  # the prefill's columns are committed
            for keep in ([1, 4, 2], [5, 1, 3], [2, 2, 2], [3, 5, 1]):
                T = max(keep)
                kv.run(torch.randint(2, 1000, (3, 3), generator=g))  # draft scratch
                kv.discard_pending()
                window = torch.randint(2, 1000, (3, T), generator=g)
                kv.run(window)
                kv.commit(keep)
                for b in range(3):
                    seqs[b] += window[b, : keep[b]].tolist()
            probe = torch.randint(2, 1000, (3, 2), generator=g)
            logits = kv.run(probe)
            for b in range(3):
                fresh = DynamicCache(config=model.config)
                ref = model(input_ids=torch.tensor([seqs[b] + probe[b].tolist()]), cache=fresh).logits[0, -2:]
                torch.testing.assert_close(logits[b], ref, rtol=1e-4, atol=1e-4)
                assert torch.equal(logits[b].argmax(-1), ref.argmax(-1))
                cols = kv.valid[b].nonzero().flatten()
                assert int(kv.lengths[b]) == len(seqs[b]) == cols.numel()
                for mine, theirs in zip(kv.cache.layers, fresh.layers):
                    torch.testing.assert_close(mine.keys[b][:, cols], theirs.keys[0][:, : cols.numel()], rtol=1e-4, atol=1e-5)
            if max_holes == 0:
                assert kv.valid.shape[1] + kv.pending == int(kv.lengths.max()) + 2  # compacted: no hole left
            else:
                assert kv.holes() > 0  # holes stayed masked, and still nothing leaked into a request


# ---------------------------------------------------------------------------------- autoregressive
@pytest.mark.parametrize("name", TINY_MODELS)
def test_batched_offload_ar_equals_b1_and_loads_once_per_step(name, tiny_checkpoint, reference):
    ck = tiny_checkpoint(name)
    method = build_method(compose([f"model={name}", "memory=low", "method=offload_ar", "hardware=emulated",
                                   "hardware.bandwidth_gbps=20", "hardware.latency_us=5"]), ck)
    prompts = _prompts(3)[:6]
    loads: list[tuple[int, int, int]] = []  # (step, layer, expert) of every miss
    cache = method.rt.cache
    acquire = cache.acquire

    def logged(uid, *, demand=True):
        handle = acquire(uid, demand=demand)
        if handle is not None and not handle.hit:
            loads.append((len(decoder.route_log.windows), uid.layer, uid.expert))
        return handle

    cache.acquire = logged
    try:
        decoder = BatchedAutoregressive(method.rt.model, GREEDY, moe=method.rt.moe, num_experts=method.rt.om.num_experts)
        method.reset()
        run = decoder.generate_batch(prompts, NEW)
        assert run.tokens == [reference(name, ck, p) for p in prompts]
        per_step = defaultdict(int)
        for key in loads:
            per_step[key] += 1
        assert loads and max(per_step.values()) == 1  # an expert is loaded at most once per batched step
        assert run.stats["iterations"] == NEW - 1 and run.stats["h2d_bytes"] > 0
        # the harness path: the method's own batched form gives the same tokens
        method.reset()
        assert method.generate_batch(prompts[:3], NEW, [None] * 3).tokens == run.tokens[:3]
    finally:
        cache.acquire = acquire
        method.close()


# ---------------------------------------------------------------------------------- membership
def test_requests_join_and_leave_independently(tiny_checkpoint, reference):
    name = "tiny_qwen"
    ck = tiny_checkpoint(name)
    method = build_method(_cfg(name, "low", "K=3"), ck)
    prompts = _prompts(4)
    lengths = [14, 24, 17, 6, 20]
    try:
        engine = method.make_engine()
        engine.begin_run()
        first = [engine.submit(prompts[i], lengths[i]) for i in range(3)]
        engine.step()  # admits (prefill) and runs one iteration
        engine.step()
        assert engine.kv.batch_size == 3
        late = [engine.submit(prompts[i], lengths[i]) for i in range(3, 5)]  # join a running batch
        sizes = []
        while engine.queue or engine.active:
            engine.step()
            sizes.append(engine.kv.batch_size)
        assert max(sizes) == 5 and sizes[-1] == 0 and len(set(sizes)) > 2  # joined, then left one by one
        for i, req in enumerate(first + late):
            assert req.tokens == reference(name, ck, prompts[i], lengths[i]), f"request {i}"
    finally:
        method.close()


def test_stochastic_request_does_not_depend_on_its_batch(tiny_checkpoint):
    """temperature > 0: a request's seeded samples are those of its own B=1 run (per-request generators,
    drawn in the B=1 engine's order)."""
    name = "tiny_phi"
    method = build_method(_cfg(name, "high", "K=4", "temperature=0.8"), tiny_checkpoint(name))
    prompts = _prompts(5)[:3]
    params = SamplingParams(temperature=0.8)
    try:
        single = SpeculativeEngine(method.rt, 4, params)
        alone = []
        for i, p in enumerate(prompts):
            method.reset()
            alone.append(single.generate(p, 20, torch.Generator().manual_seed(100 + i))[0])
        engine = SpeculativeEngine(method.rt, 4, params)
        method.reset()
        run = engine.generate_batch(prompts, 20, [torch.Generator().manual_seed(100 + i) for i in range(3)])
        assert run.tokens == alone
        assert len({tuple(t) for t in alone}) == 3
    finally:
        method.close()


# ---------------------------------------------------------------------------------- pieces
def test_greedy_verify_batch_matches_per_request():
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 5, 11
    logits = torch.randn(B, K + 1, V, generator=g)
    target = logits.argmax(-1)
    drafts = target[:, :K].clone()
    for b, n in enumerate([0, 2, 5, 1, 5, 3]):  # first mismatch (5 = all accepted)
        if n < K:
            drafts[b, n] = (drafts[b, n] + 1) % V
    limits = torch.tensor([5, 5, 5, 0, 3, 2])
    accepted, tokens = greedy_verify_batch(drafts, logits, limits)
    for b in range(B):
        k = int(limits[b])
        assert (accepted[b], tokens[b]) == greedy_verify(drafts[b, :k], logits[b, : k + 1])
    assert accepted == [0, 2, 5, 0, 3, 2]


def test_padding_filter_sends_padded_tokens_to_no_expert():
    E = 8
    valid = torch.tensor([[False, True, True], [True, True, True]])  # [B, T]
    idx = torch.randint(0, E, (6, 2))
    w = torch.rand(6, 2)
    seen = []

    def inner(layer, i, ww):
        seen.append(i.shape[0])
        return i, ww * 2

    out_idx, out_w = padding_filter(valid, E, inner)(3, idx, w)
    assert seen == [5]  # the inner filter sees the real tokens only
    assert (out_idx[0] == E).all() and (out_w[0] == 0).all()
    assert torch.equal(out_idx[1:], idx[1:]) and torch.allclose(out_w[1:], w[1:] * 2)


# ---------------------------------------------------------------------------------- experiment=batch
def test_batch_experiment_writes_records_and_refuses_what_does_not_fit(tmp_path, tiny_checkpoint):
    from specter.assembly.sizing import footprint_at, largest_batch
    from specter.experiments.batch import BATCH_COLUMNS, run_batch

    tiny_checkpoint("tiny_dsv2")
    out = tmp_path / "batch"
    args = ["experiment=batch", "model=tiny_dsv2", "memory=low", "method.quant=rtn", "hardware=emulated",
            "hardware.bandwidth_gbps=20", "hardware.latency_us=5", "dataset=humaneval", "num_prompts=2",
            "max_new_tokens=8", "warmup_tokens=2", "progress=false", f"assets_dir={FIXTURES / 'datasets'}",
            "allow_hub=false", "batch.sizes=[1,2]", "method.staging_buffers=0"]
    run_batch(compose([*args, f"output_dir={out}"]))
    digests = {}
    for B in (1, 2):
        batch = pd.read_csv(out / f"B={B}" / "batch.csv")
        assert tuple(batch.columns) == BATCH_COLUMNS and tuple(batch.columns[:11]) == (
            "method", "model", "memory", "batch_size", "dataset", "tpot_median_ms", "tpot_p90_ms", "throughput_tok_s",
            "distinct_experts_per_layer", "h2d_bytes_per_token", "acceptance")
        row = batch.iloc[0]
        assert row.batch_size == B and row.requests == 2 and row.batches == 2 // B and row.new_tokens == 16
        assert row.throughput_tok_s > 0 and row.tpot_p90_ms >= row.tpot_median_ms > 0 and row.h2d_bytes_per_token > 0
        assert row.footprint_mb <= row.budget_mb
        records = pd.read_csv(out / f"B={B}" / "records.csv")
        assert len(records) == 2 and (records.batch_size == B).all() and records.h2d_bytes.isna().all()
        digests[B] = records.sort_values("prompt_index").output_digest.tolist()
    assert digests[1] == digests[2]  # greedy: the same tokens whatever the batch size
    summary = pd.read_csv(out / "batch_summary.csv")
    assert sorted(summary.batch_size) == [1, 2]

    # a budget that holds one request but not two: B=2 is refused with the number that fits, B=1 runs
    method = build_method(compose([*args, f"output_dir={tmp_path / 'probe'}"]), tiny_checkpoint("tiny_dsv2"))
    one, two, method_budget = footprint_at(method, 1), footprint_at(method, 2), method.rt.budget_bytes
    method.close()
    budget_mb = (one.total + (two.total - one.total) // 2) / (1 << 20)
    assert largest_batch(one, two, int(budget_mb * (1 << 20))) == 1 and method_budget > one.total
    assert two.kv_cache == 2 * one.kv_cache and two.scratch == 2 * one.scratch
    tight = tmp_path / "tight"
    run_batch(compose([*args, f"memory.budget_mb={budget_mb}", f"output_dir={tight}"]))
    summary = pd.read_csv(tight / "batch_summary.csv").set_index("batch_size")
    assert summary.loc[1, "status"] == "measured"
    assert "refused" in summary.loc[2, "status"] and "largest batch that fits is B=1" in summary.loc[2, "status"]
    assert not (tight / "B=2").exists()


def test_batched_specmoeoff_equals_b1_greedy(tiny_checkpoint, reference):
    """The separate-draft baseline batched: its own draft cache per request (in the target's row order),
    prompts of length 1..16, requests leaving at different times."""
    name = "tiny_qwen"
    ck = tiny_checkpoint(name)
    method = build_method(compose([f"model={name}", "memory=low", "method=specmoeoff", "method.quant=rtn",
                                   "hardware=emulated", "hardware.bandwidth_gbps=20", "hardware.latency_us=5"]), ck)
    _corrupt_draft_of(method.draft_moe)
    prompts = _prompts(6)[:5]
    lengths = [NEW, 9, NEW, 14, 5]
    try:
        run = method.generate_batch(prompts, lengths, [None] * 5)
        assert run.tokens == [reference(name, ck, p, n) for p, n in zip(prompts, lengths)]
        assert len({round(r.stats["accepted_fraction"], 3) for r in run.requests}) > 1
        # two microbatches (3 + 2 requests) taking windows in turn on the one cache
        first, second = method.batch_engines
        assert run.stats["microbatches"] == 2 and first.iterations > 0 and second.iterations > 0
        assert run.stats["iterations"] == first.iterations + second.iterations
        assert first.route_log is second.route_log and first.drafter is not second.drafter
        fp1, fp4 = footprint_at(method, 1), footprint_at(method, 4)
        d, rt = method.draft_extra, method.rt
        assert fp1.draft_non_expert == d["non_expert"] and fp1.kv_cache == rt.footprint.kv_cache
        assert fp4.total - fp1.total == 3 * (fp1.kv_cache + fp1.scratch)  # the target's and the draft's, per request
        assert fp1.kv_cache - d["kv_cache"] == d["kv_cache"]  # the draft's KV covers the target's positions
    finally:
        method.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_draft_step_kernel_matches_reference(dtype):
    """A batched draft step (T > 1) on the CPU's int4mm layout runs the grouped path on weights
    dequantized from that layout: exactly the packed weights, and the reference MoE's output."""
    from specter.kernels.draft_moe import (
        dequantize_int4pack,
        draft_moe_reference,
        prepare_int4mm,
    )
    from specter.quant.draft import DraftExperts, draft_forward
    from specter.quant.int4 import dequantize, quantize_rtn

    E, H, I, k = 16, 128, 128, 4
    g = torch.Generator().manual_seed(0)
    gate_up = quantize_rtn(torch.randn(E, 2 * I, H, generator=g) * 0.05, 128)
    down = quantize_rtn(torch.randn(E, H, I, generator=g) * 0.05, 128)
    prepared = prepare_int4mm(gate_up, down, dtype)
    some = torch.tensor([5, 0, 15])
    for packed, w, sz, gs in ((gate_up, prepared.gate_up, prepared.gate_up_sz, prepared.group_size_gu),
                              (down, prepared.down, prepared.down_sz, prepared.group_size_dn)):
        got = dequantize_int4pack(w.index_select(0, some), sz.index_select(0, some), gs, prepared.block_n, torch.float32)
        scaled_as_prepared = replace(packed, scales=packed.scales.to(dtype))  # the layout keeps scales in `dtype`
        assert torch.equal(got, dequantize(scaled_as_prepared, torch.float32, some))
    draft = DraftExperts(None, prepared, "rtn")
    act = torch.nn.functional.silu
    for T in (1, 2, 9, 40):
        x = torch.randn(T, H, generator=g).to(dtype)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        ref = draft_moe_reference(x, idx, w, gate_up, down, act).float()
        out = draft_forward(x, idx, w, draft, act).float()
        # one token runs the int4mm path, whose GEMMs compute in bf16 (draft_moe.INT4MM_COMPUTE)
        tol = 1e-5 if dtype == torch.float32 and T > 1 else 2e-2
        assert ((out - ref).norm() / ref.norm()).item() < tol, T


def test_staging_buffers_leave_room_for_the_largest_batch(tiny_checkpoint):
    """Specter fills the tier's headroom with staging buffers; under experiment=batch it leaves the KV
    cache and scratch of the largest batch size that fits, so every size runs on one device layout."""
    from specter.assembly.sizing import footprint_at

    tiny_checkpoint("tiny_dsv2")
    base = ["model=tiny_dsv2", "memory=high", "method=specter", "method.quant=rtn", "hardware=emulated",
            "hardware.bandwidth_gbps=20", "hardware.latency_us=5", "method.staging_per_layer=64",
            "memory.slots=budget"]  # budget-bound: the tiny tier's own rule
    single = build_method(compose(base), tiny_checkpoint("tiny_dsv2"))
    batched = build_method(compose([*base, "experiment=batch", "batch.sizes=[1,32]"]), tiny_checkpoint("tiny_dsv2"))
    try:
        assert single.rt.cache.staging > batched.rt.cache.staging
        assert footprint_at(batched, 32).total <= batched.rt.budget_bytes < footprint_at(single, 32).total
    finally:
        single.close()
        batched.close()


def test_batched_oracle_prefetch_is_exact_and_untimed(tiny_checkpoint, reference):
    """prefetch=oracle batched: a host-computed dry run of every request's window picks the experts;
    greedy output unchanged, the plan covers the verified experts, the probe is excluded from timing."""
    name = "tiny_qwen"
    ck = tiny_checkpoint(name)
    method = build_method(_cfg(name, "low", "K=4", "method.prefetch=oracle"), ck)
    prompts = _prompts(7)[:3]
    try:
        run = method.generate_batch(prompts, NEW, [None] * 3)
        assert run.tokens == [reference(name, ck, p) for p in prompts]
        assert run.stats["prefetch_recall"] > 0.5
        assert all(r.clock.excluded_s > 0 for r in run.requests)
    finally:
        method.close()
