"""The engine itself on the virtual clock (specter/projection/virtual.py, engine_run.py).

Every in-process method is built by the harness's method builder on the tiny proxy, at the real
model's slot counts, and runs with a `VirtualLink` and the operation meter. These tests check the
schedule's semantics on the clock, not any timing of this machine: greedy outputs stay lossless,
target_only is exactly the cost model's resident step, copies hidden behind compute cost nothing
extra, a slot is never overwritten before its last read nor read before its copy landed, the
engine-driven offload_ar agrees with the replay over the same routes, and two runs give the same
bytes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import compose

FAST = ["experiment=project", "project.prompts=1", "project.new_tokens=10", "project.warmup_tokens=4",
        "project.tokens=8", "project.routes=independent", "project.quant=rtn", "project.profile=[]"]  # one row each


@pytest.fixture(scope="module")
def dsv2_high():
    """All seven methods projected once for dsv2 at the high tier (untrained or trained proxy, as present)."""
    from specter.experiments.project import project_rows

    return project_rows(compose([*FAST, "model=dsv2", "memory=high"]))


def _engine(rows):
    return {r["method"]: r for r in rows if r["source"] == "engine"}


def test_every_in_process_method_projects(dsv2_high):
    rows, facts = dsv2_high
    engine = _engine(rows)
    assert list(engine) == ["target_only", "offload_ar", "mo_sc", "mo_sm", "specmoeoff", "moe_spec", "specter"]
    assert all(float(r["tpot_ms"]) > 0 for r in engine.values())
    for name in ("specmoeoff", "moe_spec", "specter"):
        assert 0 <= float(engine[name]["acceptance"]) <= 1
    for name in ("offload_ar", "mo_sc", "mo_sm", "specmoeoff", "moe_spec", "specter"):
        assert float(engine[name]["loads_per_token"]) >= 0 and 0 <= float(engine[name]["copy_busy"]) <= 1
    # the slots are the real model's plan (what experiment=plan derives), not the proxy's budget
    assert engine["offload_ar"]["resident"] == "16" and engine["mo_sm"]["resident"] == "32"
    assert engine["specter"]["paper_tpot_ms"] == "72.2" and engine["specter"]["ratio"]


def test_greedy_outputs_stay_lossless_on_the_virtual_clock(dsv2_high):
    runs = dsv2_high[1]["runs"]
    reference = runs["target_only"].tokens
    for name in ("offload_ar", "mo_sc", "mo_sm", "specmoeoff", "specter"):  # moe_spec is lossy by design
        assert runs[name].tokens == reference, name


def test_target_only_is_the_cost_models_resident_step(dsv2_high):
    from specter.projection.cost_model import cost_model

    run = dsv2_high[1]["runs"]["target_only"]
    assert run.tpot == pytest.approx(cost_model("dsv2", "a100_40gb_pcie4").target_step_resident(), rel=1e-9)


def slot_violations(machine) -> list[str]:
    """Per device buffer: no copy overlaps a read of it, and every read starts after the copy that filled it."""
    bad = []
    copies = {}
    for c in machine.copies:
        copies.setdefault(c.buffer, []).append((c.start, c.end))
    for buf, reads in machine.reads.items():
        fills = sorted(copies.get(buf, []))
        for r0, r1 in reads:
            for c0, c1 in fills:
                if c0 < r1 - 1e-12 and r0 < c1 - 1e-12:
                    bad.append(f"buffer {buf:#x}: copy [{c0:.6f}, {c1:.6f}] overlaps read [{r0:.6f}, {r1:.6f}]")
            before = [c for c in fills if c[0] <= r0]
            if before and before[-1][1] > r0 + 1e-12:
                bad.append(f"buffer {buf:#x}: read at {r0:.6f} before its copy landed at {before[-1][1]:.6f}")
    return bad


def test_slot_check_catches_a_wrong_schedule():
    from types import SimpleNamespace

    from specter.projection.virtual import CopyRecord

    wrong = SimpleNamespace(copies=[CopyRecord(1, 0x10, 0.0, 0.0, 2.0)], reads={0x10: [(1.0, 1.5)]})
    assert slot_violations(wrong)
    right = SimpleNamespace(copies=[CopyRecord(1, 0x10, 0.0, 0.0, 2.0)], reads={0x10: [(2.0, 2.5)]})
    assert not slot_violations(right)


@pytest.mark.parametrize("name", ["offload_ar", "mo_sm", "specmoeoff", "specter"])
def test_a_slot_is_never_reused_before_its_copy_lands(dsv2_high, name):
    machine = dsv2_high[1]["runs"][name].machine
    assert machine.copies and machine.reads
    assert slot_violations(machine) == []


def _run_one(method: str, memory: str, device, prompts, new_tokens: int):
    """One method on the proxy of dsv2 at the real model's slots, on `device`."""
    from specter.experiments.project import method_slots
    from specter.assembly.runtime import model_checkpoint
    from specter.models.tiny import tiny_dir
    from specter.projection.cost_model import CostModel, real_shape
    from specter.projection.engine_run import proxy_overrides, run_method

    cfg = compose([*FAST, "model=dsv2", f"memory={memory}"])
    slots, K = method_slots(cfg, "dsv2")
    trained = (tiny_dir("tiny_dsv2", trained=True) / "config.json").is_file()
    mcfg = compose(proxy_overrides("tiny_dsv2", trained, memory, method, slots[method], K, "rtn", 0))
    checkpoint = model_checkpoint(mcfg)
    cm = CostModel(real_shape("dsv2"), device)
    return run_method(mcfg, checkpoint, cm, prompts, new_tokens, 4, slots[method]), cm, slots[method]


def test_copies_hidden_behind_compute_cost_nothing_extra():
    """With copies cheap enough to hide behind the draft, Specter's decode is its compute alone (the max of
    the two streams, not their sum), though the copy stream was busy; with a slow link compute waits."""
    from specter.projection.cost_model import load_device

    prompt = [torch.tensor([[5, 17, 33, 2, 9, 40, 11, 3]])]
    base = load_device("a100_40gb_pcie4")
    fast = base.replace(h2d_bandwidth=base.h2d_bandwidth * 20, h2d_latency=0.0)
    for device, hidden in ((fast, True), (base.replace(h2d_bandwidth=base.h2d_bandwidth / 50), False)):
        run, _, _ = _run_one("specter", "low", device, prompt, 24)
        m = run.machine
        ends = [f.end for f in m.forwards if f.kind == "target"]
        t0, t1 = ends[-run.decode_forwards], ends[-1]  # the measured record's first commit .. its last
        compute = sum(max(0.0, min(b, t1) - max(a, t0)) for s, _, a, b in m.clock.log if s == "compute")
        copying = m.copy_busy(t0, t1)
        if hidden:
            assert copying > 0.05 * (t1 - t0)  # a sum would show
            assert (t1 - t0) - compute < 0.01 * (t1 - t0)
        else:
            assert (t1 - t0) - compute > 0.2 * (t1 - t0)


@pytest.mark.parametrize("memory", ["high", "low"])  # low: M=4 < top-6, the staging buffers serve
def test_engine_offload_ar_agrees_with_the_replay_of_its_own_routes(memory):
    """The replay (`simulate.offload_ar`, one LRU per real layer) over the routes the engine-driven offload_ar
    took (each tiny layer's routes for every real layer of its block) gives the same TPOT: the block charging
    of the engine run and the per-real-layer replay order the same work (measured: equal to 1e-12)."""
    from specter.projection.cost_model import load_device
    from specter.projection.mapping import layer_blocks
    from specter.projection.simulate import offload_ar

    prompt = [torch.tensor([[7]])]  # a one-token prefill is one decode step: the replay starts from the same cache
    run, cm, (M, S) = _run_one("offload_ar", memory, load_device("a100_40gb_pcie4"), prompt, 20)
    windows = run.route_windows  # the measured record's route log: prefill + 19 steps, one window each
    assert len(windows) == 20
    tiny_layers = sorted(windows[0])
    blocks = layer_blocks(len(tiny_layers), cm.s.moe_layers)
    routes = [{real: sorted(w[t]) for t, block in zip(tiny_layers, blocks) for real in block} for w in windows]
    replay = offload_ar(cm, routes, M, S)
    ends = replay["step_ends"]
    assert run.tpot == pytest.approx((ends[-1] - ends[0]) / (len(ends) - 1), rel=1e-9)


def test_two_runs_write_identical_csvs(tmp_path):
    from specter.experiments.dispatch import run_experiment

    args = [*FAST, "model=qwen15moe", "memory=low", "project.methods=[offload_ar,specter]"]
    a = run_experiment(compose([*args, f"output_dir={tmp_path / 'a'}"]))
    b = run_experiment(compose([*args, f"output_dir={tmp_path / 'b'}"]))
    for name in ("projection.csv", "timeline.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "projection.csv").read_text().count(",engine,") == 2


OFFLOADING = ("offload_ar", "mo_sc", "mo_sm", "specmoeoff", "moe_spec", "specter")


def test_rows_carry_loads_over_the_belady_bound_at_their_own_slots(dsv2_high):
    """Every offloading row: its decode's real loads over the Belady bound at its own slots (>= 1: no policy beats
    Belady), the bound in loads/token (<= the measured loads/token), and Specter's bound beside it."""
    rows, facts = dsv2_high
    engine = _engine(rows)
    spec = float(engine["specter"]["belady_loads_per_token"])
    for name in OFFLOADING:
        r = engine[name]
        loads, bound, ratio = (float(r[k]) for k in ("loads_per_token", "belady_loads_per_token", "loads_over_belady"))
        assert 0 < bound <= loads + 1e-9 and ratio >= 1 - 1e-9, (name, loads, bound, ratio)
        assert ratio == pytest.approx(loads / bound, rel=1e-3)
        assert float(r["specter_belady_loads_per_token"]) == pytest.approx(spec, abs=1e-4)
        assert float(r["loads_per_window_layer"]) > 0
    # the measured run's own loads over its own bound (not the records' per-tiny-layer figures)
    run = facts["runs"]["specter"]
    assert run.extra["loads_over_belady"] == pytest.approx(run.loads_per_token / run.extra["belady_loads_per_token"])
    for r in [engine["target_only"], *(r for r in rows if r["source"] == "replay")]:
        assert not r["belady_loads_per_token"] and not r["specter_belady_loads_per_token"]


def test_specter_keeps_window_residency_and_the_baselines_lru(dsv2_high):
    engine = _engine(dsv2_high[0])
    assert engine["specter"]["residency"] == "window"
    for name in ("offload_ar", "mo_sc", "mo_sm", "specmoeoff", "moe_spec"):
        assert engine[name]["residency"] == "lru", name
    assert engine["target_only"]["residency"] == ""


def test_copy_bound_check_prints_specters_floor_beside_each_rival(dsv2_high):
    from specter.experiments.project import format_projection

    text = format_projection(*dsv2_high)
    assert "copy-bound check" in text and "Specter floor ms" in text
    for name in ("offload_ar", "mo_sm", "specmoeoff", "moe_spec"):
        assert any(line.strip().startswith(name) and ("Specter" in line or "won" in line)
                   for line in text.splitlines()), name


def test_the_proxy_holds_the_real_plans_staging_per_layer():
    """A proxy layer stands for a block of real layers and its loads count once per real layer, so one proxy
    staging buffer holds a block's worth of experts: the proxy gets the plan's buffers per real MoE layer times
    its own MoE layers, as a CPU run sized by the same plan does (assembly.real_plan.PlannedSlots)."""
    from specter.assembly.real_plan import PlannedSlots
    from specter.projection.cost_model import real_shape
    from specter.projection.steps import Proxy

    px = Proxy.__new__(Proxy)  # the slots arithmetic only: no config, no checkpoint
    px.slots, px.real, px._proxy_layers = {"offload_ar": (16, 31), "target_only": (None, 0)}, "dsv2", 4
    assert real_shape("dsv2").moe_layers == 26
    assert px.proxy_slots("offload_ar") == (16, 5)  # 31 buffers over 26 real MoE layers -> 4 proxy layers
    assert px.proxy_slots("offload_ar")[1] == PlannedSlots(16, 31 / 26, "plan").staging(4)
    assert px.proxy_slots("target_only") == (None, 0)
