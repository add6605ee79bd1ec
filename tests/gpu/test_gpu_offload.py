"""Offloading runtime on a real GPU: pinned store, CudaLink, slot cache, expert-wise MoE."""

import random
import time

import pytest
import torch

from specter.kernels.reference import moe_reference
import torch.nn.functional as F

from specter.offload import (
    CudaLink,
    ExpertCache,
    ExpertLayout,
    ExpertUID,
    HostExpertStore,
    expert_wise_moe,
    make_link,
    token_wise_moe,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, I = 256, 128
LAYER = 1


def _store(E: int, dtype=torch.float16, seed: int = 0, layers=(LAYER,)):
    g = torch.Generator().manual_seed(seed)
    gate_up_all = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)  # [E, 2I, H]
    down_all = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)  # [E, H, I]
    store = HostExpertStore(ExpertLayout(H, I, dtype), list(layers), E, pin_memory=True)
    for layer in layers:
        for e in range(E):
            store.write_part(ExpertUID(layer, e), "gate", gate_up_all[e, :I])
            store.write_part(ExpertUID(layer, e), "up", gate_up_all[e, I:])
            store.write_part(ExpertUID(layer, e), "down", down_all[e])
    store.assert_complete()
    return store, gate_up_all.cuda(), down_all.cuda()


def test_pinned_store_buffers():
    store, _, _ = _store(4)
    for e in range(4):
        buf = store.buffer(ExpertUID(LAYER, e))
        assert buf.is_pinned() and buf.is_contiguous()
        assert store.views((LAYER, e))[0].data_ptr() == buf.data_ptr()


def test_cuda_link_copies_and_orders_after_event():
    link = make_link("cuda", device="cuda")
    assert isinstance(link, CudaLink)
    n = 8 << 20  # 16 MB fp16
    src = torch.randn(n).half().pin_memory()
    dst = torch.empty(n, dtype=torch.float16, device="cuda")
    # compute still writing the slot when the copy is submitted: `after` must hold the copy back
    torch.cuda._sleep(50_000_000)  # ~tens of ms of device time on the compute stream
    dst.fill_(-1.0)
    last_use = torch.cuda.Event()
    last_use.record()
    t0 = time.perf_counter()
    ticket = link.submit(src, dst, after=last_use)
    submit_s = time.perf_counter() - t0
    assert submit_s < 0.01  # submission does not block the host
    blocked = ticket.wait()  # compute stream waits; host does not
    assert blocked < 0.01
    assert torch.equal(dst.cpu(), src)  # copy landed after the fill
    assert ticket.done()
    link.synchronize()
    assert link.bytes_copied == 2 * n and link.copies == 1 and link.busy_seconds > 0
    link.close()


def test_cuda_copies_overlap_compute():
    link = CudaLink("cuda")
    n = 32 << 20  # 64 MB fp16 per copy
    srcs = [torch.randn(n // 8).half().repeat(8).pin_memory() for _ in range(4)]
    dsts = [torch.empty(n, dtype=torch.float16, device="cuda") for _ in range(4)]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def compute(iters):
        b = a
        for _ in range(iters):
            b = torch.tanh(b @ a)
        return b

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def copies():
        for t in [link.submit(s, d) for s, d in zip(srcs, dsts)]:
            t.wait()

    timed(copies)  # warm-up
    compute(2)
    copy_s = timed(copies)
    per = timed(lambda: compute(10)) / 10
    iters = max(1, int(copy_s / per))
    compute_s = timed(lambda: compute(iters))
    both_s = timed(lambda: _overlap(link, srcs, dsts, compute, iters))
    assert both_s < 0.85 * (copy_s + compute_s), (both_s, copy_s, compute_s)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d.cpu(), s)
    link.close()


def _overlap(link, srcs, dsts, compute, iters):
    """Copies on the copy stream while the compute stream runs matmuls."""
    tickets = [link.submit(s, d) for s, d in zip(srcs, dsts)]
    compute(iters)
    for t in tickets:
        t.wait()


def test_cuda_cache_random_traffic_keeps_slots_consistent():
    E = 12
    store, _, _ = _store(E, layers=(1, 2))
    link = CudaLink("cuda")
    caps = {1: 3, 2: 1}
    cache = ExpertCache(store, link, caps, "cuda", torch.float16)
    rng = random.Random(0)
    held = []
    for _ in range(300):
        layer = rng.choice([1, 2])
        op = rng.random()
        if op < 0.5:
            h = cache.acquire(ExpertUID(layer, rng.randrange(E)))
            if h is None:
                assert cache.protected_count(layer) == caps[layer]
            else:
                held.append(h)
        elif op < 0.6:
            cache.prefetch(ExpertUID(layer, rng.randrange(E)))
        elif op < 0.65:
            cache.release_prefetches(layer)
        elif held:
            h = held.pop(rng.randrange(len(held)))
            cache.wait(h)
            gate_up, down = cache.views(h)
            host_gu, host_down = store.views(h.uid)
            assert torch.equal(gate_up.cpu(), host_gu) and torch.equal(down.cpu(), host_down)
            gate_up.mul_(1.0)  # a read-modify-write use on the compute stream before release
            cache.release(h)
        for lay in (1, 2):
            assert len(cache.resident(lay)) <= caps[lay]
            assert {h.uid.expert for h in held if h.uid.layer == lay} <= cache.resident(lay)
    link.synchronize()
    torch.cuda.synchronize()
    for lay in (1, 2):
        for expert, slot in cache._layer(lay).policy.residents().items():
            assert torch.equal(cache.slot_buffer(lay, slot).cpu(), store.buffer(ExpertUID(lay, expert)))
    c = cache.counters
    assert c.h2d_bytes == c.loads * store.nbytes_per_expert == link.bytes_copied
    cache.reset()
    assert cache.resident(1) == {0, 1, 2} and cache.resident(2) == {0}
    link.close()


@pytest.mark.parametrize("E,k", [(4, 2), (16, 4), (60, 4), (60, 6)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_expert_wise_equals_reference(E, k, dtype):
    store, gate_up_all, down_all = _store(E, dtype=dtype, seed=E + k)
    link = CudaLink("cuda")
    g = torch.Generator().manual_seed(E * k)
    for T in (1, 5, 17):
        x = torch.randn(T, H, generator=g).to(dtype).cuda()  # [T, H]
        topk_idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).cuda()  # [T, k]
        topk_w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dtype).cuda()  # [T, k]
        ref = moe_reference(x, topk_idx, topk_w, gate_up_all, down_all, F.silu)
        outs = []
        for M in sorted({c for c in (1, k - 1, k, E) if c >= 1}):
            init = torch.randperm(E, generator=g)[:M].tolist()
            cache = ExpertCache(store, link, {LAYER: M}, "cuda", dtype, initial_residents={LAYER: init})
            out = expert_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
            torch.testing.assert_close(out, ref)
            outs.append(out)
            needed = set(topk_idx.flatten().tolist())
            assert cache.counters.demand_misses == len(needed - set(init))
            tw = token_wise_moe(x, topk_idx, topk_w, LAYER, cache, F.silu)
            torch.testing.assert_close(tw, ref)
        for o in outs[1:]:  # independent of cache state
            torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
    link.close()
