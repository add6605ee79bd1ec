import pytest

from specter.projection.clock import VirtualClock


def test_copy_overlapping_compute_costs_the_max_not_the_sum():
    c = VirtualClock()
    c.enqueue("compute", "layer", 3.0)
    c.enqueue("copy", "expert", 2.0)
    assert c.sync() == pytest.approx(3.0)  # not 5.0
    c = VirtualClock()
    c.enqueue("compute", "layer", 1.0)
    c.enqueue("copy", "expert", 4.0)
    assert c.sync() == pytest.approx(4.0)


def test_wait_advances_only_to_the_event():
    c = VirtualClock()
    ev = c.enqueue("copy", "a", 2.0)
    c.enqueue("copy", "b", 5.0)  # later work on the copy stream must not delay compute
    c.wait("compute", ev)
    assert c.now["compute"] == pytest.approx(2.0)
    c.enqueue("compute", "x", 10.0)
    c.wait("compute", ev)  # already past it: no move
    assert c.now["compute"] == pytest.approx(12.0)


def test_compute_on_an_expert_waits_for_its_copy():
    c = VirtualClock()
    c.copy_into(("L0", 0), "h2d", 4.0)
    ev = c.compute_on(("L0", 0), "expert", 1.0)
    assert ev.time == pytest.approx(5.0)


def test_slot_not_reused_before_its_copy_lands_and_last_compute_finishes():
    c = VirtualClock()
    slot = ("L0", 0)
    c.copy_into(slot, "h2d e1", 2.0)  # lands at 2
    c.enqueue("compute", "attention", 3.0)  # compute busy to 3
    use = c.compute_on(slot, "e1", 1.0)  # 3..4
    # the next copy into the same slot waits for the last compute (4), not for the copy stream (2)
    nxt = c.copy_into(slot, "h2d e2", 2.0)
    assert use.time == pytest.approx(4.0)
    assert nxt.time == pytest.approx(6.0)
    # a different slot's copy is free to start at once
    other = c.copy_into(("L0", 1), "h2d e3", 1.0)
    assert other.time == pytest.approx(7.0)  # copy stream is in order: after e2's copy
    assert c.compute_on(slot, "e2", 1.0).time == pytest.approx(7.0)  # 6 (copy) .. 7


def test_bad_stream_and_cost():
    c = VirtualClock()
    with pytest.raises(ValueError):
        c.enqueue("dma", "x", 1.0)
    with pytest.raises(ValueError):
        c.enqueue("copy", "x", -1.0)
