"""scripts/bench_window_levers.py: windows rebuilt from a record's forwards, the post-verify drafting bound,
the residency lookahead and the draft-confidence tables, on hand-made inputs."""

from __future__ import annotations

from types import SimpleNamespace as F

import pytest

from scripts.bench_window_levers import (Positions, Window, above_floor, hideable, horizon_loads, lookahead_traced,
                                        parse_cell, pass_floor, probe, record_horizons, record_windows, threshold_rows)


def forwards(*spec):
    """("t"|"d", end) pairs -> forward records."""
    return [F(kind="target" if k == "t" else "draft", end=e) for k, e in spec]


def test_passes_from_forwards_skip_the_prefill_and_keep_plain_steps():
    fw = forwards(("t", 1.0), ("d", 1.1), ("d", 1.2), ("t", 2.0), ("d", 2.1), ("t", 2.5), ("t", 2.7))
    ws = record_windows(fw, drafted=[2, 1], accepted=[2, 0], K=2)
    assert ws == [Window(1.0, 1.2, 2.0, 2, 2, 2), Window(2.0, 2.1, 2.5, 1, 0, 2),
                  Window(2.5, 2.5, 2.7, 0, 0, 2)]  # the last target forward: a plain step, no draft phase
    assert ws[0].full and not ws[1].full and not ws[2].full
    assert hideable(ws) == pytest.approx(0.1)  # the full window hides the next draft phase (0.1 s)


def test_pass_floor_counts_what_cannot_be_on_the_device_when_the_draft_ends():
    w = Window(0.0, 0.25, 1.0, 4, 2, 4)
    blocks = {0: 2, 1: 1}  # tiny layer 0 stands for 2 real layers
    routes = {0: {1, 2, 3, 4, 5}, 1: {1, 2}}  # M = 3: layer 0 is 2 short (x 2 real layers), layer 1 fits
    assert pass_floor(w, routes, 3, blocks, staging=0, h2d=0.1) == pytest.approx(0.25 + 0.4)
    assert pass_floor(w, routes, 3, blocks, staging=3, h2d=0.1) == pytest.approx(0.25 + 0.1)
    assert pass_floor(w, routes, 3, blocks, staging=9, h2d=0.1) == pytest.approx(0.25)  # never below the draft
    assert pass_floor(w, routes, 5, blocks, staging=0, h2d=0.1) == pytest.approx(0.25)


def test_time_above_the_floor_splits_into_extra_copying_and_copy_idle():
    w = Window(0.0, 0.25, 1.0, 4, 2, 4)  # draft 0.25 s, verification 0.75 s
    floor = 0.25 + 0.4  # 4 loads of 0.1 s cannot be made before the draft ends
    extra, idle = above_floor(w, floor, copy_after=0.6)  # 6 loads after the draft: 2 beyond the floor's
    assert extra == pytest.approx(0.2) and idle == pytest.approx(0.15)
    assert floor + extra + idle == pytest.approx(w.end - w.start)


def test_hideable_is_the_next_draft_after_a_full_window_capped_by_the_verification():
    full = Window(0.0, 1.0, 1.5, 4, 4, 4)  # verification 0.5 s
    nxt = Window(1.5, 2.5, 3.0, 4, 1, 4)  # draft 1.0 s: only 0.5 s can hide
    short = Window(3.0, 3.2, 4.0, 3, 3, 4)  # fully accepted but shorter than K (the record's tail): not full
    last = Window(4.0, 4.1, 5.0, 4, 0, 4)
    assert hideable([full, nxt]) == pytest.approx(0.5)
    assert hideable([nxt, full]) == 0.0  # nothing follows the full window
    assert hideable([full, nxt, short, last]) == pytest.approx(0.5)
    long_verify = Window(0.0, 1.0, 3.0, 4, 4, 4)
    assert hideable([long_verify, Window(3.0, 3.25, 4.0, 4, 2, 4)]) == pytest.approx(0.25)


def test_threshold_rows_count_flags_and_caught_rejections():
    rows = [(0.0001, False), (0.0001, True), (0.003, True), (0.003, False), (0.5, True), (0.9, True)]
    out = {r["margin_below"]: r for r in threshold_rows("m", rows)}
    assert out[0.0005]["flagged_share"] == pytest.approx(2 / 6, abs=1e-4)
    assert out[0.0005]["rejections_caught"] == 1 and out[0.0005]["reject_rate_flagged"] == 0.5
    assert out[0.005]["rejections_caught"] == 2 and out[0.005]["reject_rate_flagged"] == 0.5
    assert out[0.05]["base_reject_rate"] == pytest.approx(2 / 6, abs=1e-4)


def test_positions_keep_the_accepted_prefix_and_the_first_rejection():
    import torch

    pos = Positions()
    for step in range(3):  # two requests, three draft steps
        logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 0 confident, row 1 flat (margin 0)
        pos.drafted(logits)
    pos.verified(accepted=[3, 1], limits=[3, 3])
    assert [ok for _, ok in pos.rows] == [True, True, True, True, False]
    assert pos.rows[-1][0] == pytest.approx(0.0)
    assert pos._margins == []


def test_probe_reports_without_changing_the_engine():
    class Engine:
        def _draft_sample(self, logits, step, limits):
            return "tokens"

        def _accept(self, drafts, q, target_logits, limits):
            return [1], ["t"]

    import torch

    eng, pos = Engine(), Positions()
    probe(eng, pos)
    assert isinstance(eng, Engine)
    assert eng._draft_sample(torch.tensor([[1.0, 0.0]]), 1, [1]) == "tokens"
    assert eng._accept(None, None, None, [1]) == ([1], ["t"])
    assert [ok for _, ok in pos.rows] == [True]


@pytest.mark.parametrize("bad", ["dsv2:high", "dsv2:mid:16", "dsv2:high:0", "dsv2:high:x"])
def test_parse_cell_rejects_bad_cells(bad):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_cell(bad)
    assert parse_cell("dsv2:low:16,48") == ("dsv2", "low", [16, 48])


@pytest.mark.parametrize("seed", range(6))
def test_horizon_loads_is_the_belady_bound_with_the_whole_trace_in_view_and_never_below_it(seed):
    import random

    from specter.predict.oracle import min_loads

    rng = random.Random(seed)
    for _ in range(300):
        E, T = rng.randint(2, 9), rng.randint(1, 8)
        M = rng.randint(1, E)
        ws = [set(rng.sample(range(E), rng.randint(0, E))) for _ in range(T)]
        start = set(rng.sample(range(E), rng.randint(0, M)))
        bound = min_loads(ws, M, start)
        assert horizon_loads(ws, M, start) == bound == horizon_loads(ws, M, start, L=T)
        assert all(horizon_loads(ws, M, start, L=L) >= bound for L in range(T))


def test_the_next_window_in_view_keeps_the_resident_it_needs():
    ws = [{0, 1}, {2}, {0}]  # two slots: window 1's load must evict 0 or 1; window 2 needs 0 again
    assert horizon_loads(ws, 2, L=0) == 4  # both residents unused ahead as far as it can see: it evicts 0, reloads it
    assert horizon_loads(ws, 2, L=1) == 3 == horizon_loads(ws, 2)  # seeing window 2, it evicts 1
    assert horizon_loads(ws, 2, {0, 1}, L=1) == 1  # from warm residents only expert 2 loads


def test_record_horizons_weighs_each_tiny_layer_by_its_real_layers_and_starts_from_the_prefill():
    routes = [{0: {0, 1}, 1: {5}}, {0: {2}}, {0: {0}, 1: {5}}]
    out = record_horizons(routes, {0: 2, 1: 1}, {1: {5}}, {0: 3, 1: 2}, [0, None])
    assert out == {0: 3 * 4 + 2 * 0, None: 3 * 3 + 2 * 0}


def test_lookahead_on_a_traced_run_folder(tmp_path):
    import pandas as pd

    rows = [("gsm8k", 0, 0, w, layer, e, 1) for w, layer, experts in
            [(0, 1, {0, 1}), (1, 1, {2}), (2, 1, {0}), (0, 2, {3}), (2, 2, {4})] for e in experts]
    pd.DataFrame(rows, columns=["dataset", "prompt_index", "repeat", "window", "layer", "expert", "count"]).to_csv(
        tmp_path / "routes.csv.gz", index=False)
    pd.DataFrame([{"method": "specter", "model": "tiny_x", "memory": "low", "dataset": "gsm8k", "prompt_index": 0,
                   "repeat": 0, "K": 4, "resident_experts": 2, "new_tokens": 8, "loads_over_belady": 1.2}]).to_csv(
        tmp_path / "records.csv", index=False)
    (row,) = lookahead_traced(tmp_path, [0, 1])
    # layer 1: 4 loads at horizon 0, 3 with the next window in view (the bound); layer 2: 2 loads either way
    assert row["horizon0_over_belady"] == round(6 / 5, 3) and row["horizon1_over_belady"] == 1.0
    assert (row["M"], row["windows"], row["specter_over_belady"]) == (2, 3, 1.2)


def test_lookahead_refuses_a_folder_without_a_route_log(tmp_path):
    with pytest.raises(SystemExit, match="routes.csv"):
        lookahead_traced(tmp_path, [0])
