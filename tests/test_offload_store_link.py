"""Host expert store layout and transfer links (CPU)."""

import threading
import time

import pytest
import torch

from specter.offload import (
    CompletedTicket,
    EmulatedLink,
    ExpertLayout,
    ExpertUID,
    HostExpertStore,
    ImmediateLink,
    make_link,
)

H, I = 16, 8


def _store(layers=(1, 2), E=3, dtype=torch.float32) -> HostExpertStore:
    return HostExpertStore(ExpertLayout(H, I, dtype), list(layers), E, pin_memory=False)


# ----------------------------------------------------------------------------- store
def test_layout_sizes_and_zero_copy_views():
    layout = ExpertLayout(H, I, torch.float16)
    assert layout.numel == 3 * H * I
    assert layout.nbytes == 3 * H * I * 2
    flat = torch.arange(layout.numel, dtype=torch.float16)
    gate_up, down = layout.views(flat)
    assert gate_up.shape == (2 * I, H) and down.shape == (H, I)
    assert gate_up.data_ptr() == flat.data_ptr()
    assert down.data_ptr() == flat.data_ptr() + 2 * I * H * 2
    gate_up[0, 0] = -1.0
    down[-1, -1] = -2.0
    assert flat[0] == -1.0 and flat[-1] == -2.0
    with pytest.raises(ValueError):
        layout.views(torch.zeros(layout.numel + 1, dtype=torch.float16))
    with pytest.raises(ValueError):
        layout.views(torch.zeros(layout.numel, dtype=torch.float32))


def test_store_buffers_are_contiguous_and_distinct():
    store = _store()
    assert store.nbytes_per_expert == 3 * H * I * 4
    assert store.total_bytes == 2 * 3 * store.nbytes_per_expert
    ptrs = set()
    for layer in (1, 2):
        for e in range(3):
            buf = store.buffer(ExpertUID(layer, e))
            assert buf.is_contiguous() and buf.dim() == 1 and buf.numel() == store.layout.numel
            gate_up, down = store.views((layer, e))
            assert gate_up.data_ptr() == buf.data_ptr()
            assert down.data_ptr() == buf.data_ptr() + 2 * I * H * 4
            ptrs.add(buf.data_ptr())
    assert len(ptrs) == 6
    with pytest.raises(KeyError, match="layer"):
        store.buffer(ExpertUID(0, 0))  # layer 0 is dense, not in the store
    with pytest.raises(KeyError):
        store.buffer(ExpertUID(1, 3))


def test_write_part_round_trip_and_write():
    store = _store(dtype=torch.float16)
    gate, up, down = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
    uid = ExpertUID(2, 1)
    store.write_part(uid, "up", up)  # any order
    store.write_part(uid, "down", down)
    store.write_part(uid, "gate", gate)
    gate_up, d = store.views(uid)
    torch.testing.assert_close(gate_up[:I], gate.half(), rtol=0, atol=0)
    torch.testing.assert_close(gate_up[I:], up.half(), rtol=0, atol=0)
    torch.testing.assert_close(d, down.half(), rtol=0, atol=0)
    # fused write lands in the same places
    gu2, d2 = torch.randn(2 * I, H), torch.randn(H, I)
    store.write(ExpertUID(1, 0), gu2, d2)
    gu, dd = store.views((1, 0))
    assert torch.equal(gu, gu2.half()) and torch.equal(dd, d2.half())
    with pytest.raises(ValueError, match="shape"):
        store.write_part(uid, "gate", torch.zeros(H, I))
    with pytest.raises(ValueError, match="part"):
        store.write_part(uid, "w1", torch.zeros(I, H))


def test_assert_complete_names_missing_experts():
    store = _store(layers=(1,), E=2)
    store.write(ExpertUID(1, 0), torch.zeros(2 * I, H), torch.zeros(H, I))
    store.write_part(ExpertUID(1, 1), "gate", torch.zeros(I, H))
    store.write_part(ExpertUID(1, 1), "down", torch.zeros(H, I))
    with pytest.raises(RuntimeError, match=r"layer 1 expert 1 \(up\)"):
        store.assert_complete()
    store.write_part(ExpertUID(1, 1), "up", torch.zeros(I, H))
    store.assert_complete()
    assert store.missing() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_store_refused_without_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        HostExpertStore(ExpertLayout(H, I, torch.float16), [1], 2, pin_memory=True)


# ----------------------------------------------------------------------------- links
def test_make_link_kinds():
    assert isinstance(make_link("cpu"), ImmediateLink)
    link = make_link("emulated", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    assert isinstance(link, EmulatedLink)
    link.close()
    with pytest.raises(ValueError, match="emulated"):
        make_link("nvlink")
    with pytest.raises(ValueError):
        EmulatedLink(bandwidth_bytes_per_s=0)


def test_immediate_link_copies_synchronously():
    link = ImmediateLink()
    src, dst = torch.randn(1000), torch.zeros(1000)
    t = link.submit(src, dst)
    assert t.done() and t.wait() == 0.0 and t.nbytes == 4000
    assert torch.equal(src, dst)
    assert link.bytes_copied == 4000 and link.copies == 1
    with pytest.raises(ValueError):
        link.submit(torch.zeros(3), torch.zeros(4))


def test_emulated_transfer_time_matches_model():
    """A copy never lands before latency + bytes / bandwidth, and the link accounts exactly that.

    Only lower bounds are asserted on the wall clock: a busy machine can delay the copy thread,
    never speed it up. Upper bounds on elapsed time belong to benchmarks."""
    bw, lat = 100e6, 0.005
    n = 750_000  # 3 MB fp32 -> 30 ms + 5 ms
    src, dst = torch.randn(n), torch.zeros(n)
    with EmulatedLink(bw, lat) as link:
        expected = link.transfer_seconds(4 * n)
        assert expected == pytest.approx(0.035)
        t0 = time.perf_counter()
        ticket = link.submit(src, dst)
        assert not ticket.done()
        blocked = ticket.wait()
        elapsed = time.perf_counter() - t0
        assert elapsed >= expected - 1e-3  # never earlier than the model
        assert 0 < blocked <= elapsed + 1e-3
        assert torch.equal(src, dst)  # bytes really copied
        assert link.bytes_copied == 4 * n and link.copies == 1
        assert link.busy_seconds >= expected - 1e-3


def test_emulated_copies_serialize_fifo():
    n = 250_000  # 1 MB -> 10 ms + 2 ms each
    link = EmulatedLink(100e6, 0.002)
    dst = torch.zeros(n)
    srcs = [torch.full((n,), float(i)) for i in range(4)]
    t0 = time.perf_counter()
    tickets = [link.submit(s, dst) for s in srcs]
    for j, t in enumerate(tickets):
        t.wait()
        # FIFO: when copy j has landed every earlier copy has too
        assert all(tickets[i].done() for i in range(j))
    elapsed = time.perf_counter() - t0
    per = link.transfer_seconds(4 * n)
    assert elapsed >= 4 * per - 1e-3  # one engine: no two copies overlap
    assert torch.equal(dst, srcs[-1])  # the last submitted copy wrote last
    link.synchronize()
    assert link.copies == 4 and link.busy_seconds >= 4 * per - 1e-3
    link.close()
    with pytest.raises(RuntimeError, match="closed"):
        link.submit(srcs[0], dst)


def test_emulated_copy_proceeds_while_the_caller_works():
    """The copy runs on its own thread: work done after submit hides it (nothing left to wait for)."""
    n = 250_000  # 1 MB at 100 MB/s -> 10 ms
    link = EmulatedLink(100e6, 0.0)
    copy_s = link.transfer_seconds(4 * n)
    src, dst = torch.randn(n), torch.zeros(n)
    ticket = link.submit(src, dst)
    deadline = time.perf_counter() + 20 * copy_s  # "compute" far longer than the copy
    while not ticket.done() and time.perf_counter() < deadline:
        time.sleep(copy_s / 4)
    assert ticket.done()  # landed without anyone waiting on it
    assert ticket.wait() == pytest.approx(0.0, abs=1e-3)
    assert torch.equal(src, dst)
    link.close()


def test_emulated_copy_waits_for_after():
    link = EmulatedLink(1e9, 0.0)
    gate = threading.Event()
    src, dst = torch.ones(10), torch.zeros(10)
    ticket = link.submit(src, dst, after=gate)
    time.sleep(0.02)
    assert not ticket.done() and dst.sum() == 0  # slot still in use: no overwrite yet
    gate.set()
    ticket.wait()
    assert torch.equal(dst, src)
    link.close()


def test_emulated_copy_error_surfaces_on_wait():
    link = EmulatedLink(1e9, 0.0)
    bad = link.submit(torch.ones(4), torch.zeros(4).expand(4).as_strided((4,), (0,)))  # overlapping dst
    good_src, good_dst = torch.ones(4), torch.zeros(4)
    good = link.submit(good_src, good_dst)
    with pytest.raises(RuntimeError, match="emulated copy failed"):
        bad.wait()
    good.wait()  # the engine keeps serving after a failed copy
    assert torch.equal(good_dst, good_src)
    link.close()


def test_completed_ticket():
    t = CompletedTicket(7)
    assert t.done() and t.wait() == 0.0 and t.nbytes == 7
