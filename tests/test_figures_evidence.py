"""What the figures may set side by side: one method per configuration that changes behaviour,
one hardware per figure, one defined quantity per axis, refused cells kept, like-for-like kernel
baselines, and a K sweep that says where its minimum lies. Built from small CSVs, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from specter.figures import batching, draft_kernel, headline, k_sweep, paper_compare, tpot_grid
from specter.figures.common import Output
from specter.figures.data import ResultSet
from specter.figures.labels import method_settings, record_source

COLUMNS = ["method", "model", "memory", "dataset", "prompt_index", "repeat", "hardware", "K", "tpot_ms"]


def _run(folder: Path, method: str, hardware: str, tpot: float, memory: str = "high", K=None, **method_cfg) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    extra = "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in method_cfg.items())
    (folder / "config.yaml").write_text(
        f"model:\n  name: tiny_dsv2\n  real: dsv2\nmemory:\n  name: {memory}\nmethod:\n  name: {method}\n{extra}"
        f"hardware:\n  name: {hardware}\ndataset:\n  name: humaneval\n")
    rows = [[method, "tiny_dsv2", memory, "humaneval", i, r, hardware, K, tpot + i] for r in (0, 1) for i in (0, 1)]
    pd.DataFrame(rows, columns=COLUMNS).to_csv(folder / "records.csv", index=False)
    return folder


def _out(tmp_path: Path) -> Output:
    folder = tmp_path / "figures"
    folder.mkdir(exist_ok=True)
    return Output(folder, dpi=40)


def _grid(root: Path, hardware_engines: str = "cpu", hardware_offload: str = "emulated") -> Path:
    main = root / "main"
    _run(main / "specter", "specter", hardware_offload, 10.0, K=16, prefetch="adaptive", trace_windows=False)
    _run(main / "offload_ar", "offload_ar", hardware_offload, 30.0)
    _run(main / "transformers", "transformers", hardware_engines, 4.0)
    _run(main / "target_only", "target_only", hardware_engines, 4.5)
    # the traced run of the same method: measurement only, stored apart (here not even in a trace folder)
    _run(root / "timeline" / "specter-traced", "specter", hardware_offload, 5.0, K=16, prefetch="adaptive",
         trace_windows=True)
    return root


# ---------------------------------------------------------------- item 4: measurement-only keys


def test_measurement_keys_never_split_a_method_and_traced_runs_stay_out_of_fig14(tmp_path):
    results = ResultSet(_grid(tmp_path / "r"))
    main = results.records("main")
    assert set(main["variant"]) == {"specter", "offload_ar", "transformers", "target_only"}  # no [trace_windows=…]
    traced = results.records("trace")
    assert list(traced["variant"].unique()) == ["specter"] and set(traced["tpot_ms"]) == {5.0, 6.0}
    out = _out(tmp_path)
    tpot_grid.build(results, out)
    fig14 = pd.read_csv(out.folder / "fig14_tpot.csv")
    avg = fig14[(fig14["method"] == "specter") & (fig14["dataset"] == "AVG")]
    assert avg["mean_ms"].tolist() == [10.5]  # the traced 5.5 ms is not averaged in
    side = pd.read_csv(out.folder / "table_traced_runs.csv")
    assert side[["method", "traced_ms", "untraced_ms"]].values.tolist() == [["specter", 5.5, 10.5]]
    headline.build(results, out)  # the headline finds one specter to compare against
    assert "specter" not in set(pd.read_csv(out.folder / "table_headline_speedup.csv")["method"])


def test_behaviour_keys_still_split(tmp_path):
    root = tmp_path / "r"
    _run(root / "a", "specter", "emulated", 10.0, prefetch="adaptive", progress=True)
    _run(root / "b", "specter", "emulated", 20.0, prefetch="none", progress=False)
    variants = set(ResultSet(root).records("main")["variant"])
    assert variants == {"specter[prefetch=adaptive]", "specter[prefetch=none]"}
    assert method_settings({"name": "x", "trace_windows": True, "prefetch": "none", "hardware.recalibrate": 1}) \
        == {"prefetch": "none"}
    assert record_source(("bench", "x"), {"trace_windows": True}) == "bench"
    assert record_source(("ablation", "staging_buffers=0"), {}) == "bench"
    assert record_source(("trace", "x"), {}) == "trace" and record_source(("main",), {}) == "main"


# ---------------------------------------------------------------- item 5: one hardware per figure


def test_engines_on_the_cpu_get_their_own_figure_and_no_headline_row(tmp_path):
    results = ResultSet(_grid(tmp_path / "r"))
    out = _out(tmp_path)
    tpot_grid.build(results, out)
    link = pd.read_csv(out.folder / "fig14_tpot.csv")
    cpu = pd.read_csv(out.folder / "fig14_tpot_cpu.csv")
    assert set(link["method"]) == {"specter", "offload_ar"} and set(link["hardware"]) == {"emulated"}
    assert set(cpu["method"]) == {"transformers", "target_only"} and set(cpu["hardware"]) == {"cpu"}
    assert (out.folder / "fig14_tpot.png").exists() and (out.folder / "fig14_tpot_cpu.png").exists()
    headline.build(results, out)
    speed = pd.read_csv(out.folder / "table_headline_speedup.csv")
    speed = speed[speed["model"] != "ALL"]
    assert set(speed["method"]) == {"offload_ar"} and speed["speedup_avg"].iloc[0] == pytest.approx(30.5 / 10.5)


def test_on_cuda_every_method_shares_one_figure(tmp_path):
    results = ResultSet(_grid(tmp_path / "r", hardware_engines="cuda", hardware_offload="cuda"))
    out = _out(tmp_path)
    tpot_grid.build(results, out)
    fig14 = pd.read_csv(out.folder / "fig14_tpot.csv")
    assert set(fig14["method"]) == {"specter", "offload_ar", "transformers", "target_only"}
    assert not (out.folder / "fig14_tpot_cpu.csv").exists()
    headline.build(results, out)
    assert set(pd.read_csv(out.folder / "table_headline_speedup.csv")["method"]) >= {"transformers", "offload_ar"}


def test_hardware_groups_rule():
    assert tpot_grid.hardware_groups(["cpu", "emulated"]) == [("fig14_tpot", ["emulated"]), ("fig14_tpot_cpu", ["cpu"])]
    assert tpot_grid.hardware_groups(["cuda"]) == [("fig14_tpot", ["cuda"])]
    assert tpot_grid.hardware_groups(["cpu"]) == [("fig14_tpot", ["cpu"])]


def test_paper_rows_across_hardware_are_left_empty_with_why(tmp_path):
    results = ResultSet(_grid(tmp_path / "r"), paper=tmp_path / "paper")
    (tmp_path / "paper").mkdir()
    pd.DataFrame({"model": ["dsv2"] * 3, "method": ["specter", "transformers", "offload_ar"], "memory": "high",
                  "dataset": "AVG", "tpot_ms": [70.0, 350.0, 140.0]}).to_csv(
        tmp_path / "paper" / "tpot_single_request.csv", index=False)
    table = paper_compare.compare(results).set_index("quantity")
    assert table.loc["speedup of Specter over Offload-AR, high memory, AVG", "here"] == pytest.approx(30.5 / 10.5)
    row = table.loc["speedup of Specter over Transformers, high memory, AVG"]
    assert pd.isna(row["here"]) and "transformers ran on cpu, specter on emulated" in row["note"]


# ---------------------------------------------------------------- item 8: Fig. 16 and Table 3


def _batch(root: Path) -> Path:
    rows = []
    for method, per_b in (("specter", {1: (10, 100, 20, 8, 128), 2: (12, 160, 24, 8, 256), 4: (15, 250, 30, 8, 512)}),
                          ("mo_sm", {1: (12, 80, 6, 128, 128), 2: (16, 120, 10, 128, 256)})):
        for b, (tpot, thr, ws, iters, tokens) in per_b.items():
            rows.append({"method": method, "model": "tiny_dsv2", "memory": "low", "batch_size": b, "dataset": "gsm8k",
                         "tpot_mean_ms": tpot, "throughput_tok_s": thr, "distinct_experts_per_layer": ws,
                         "iterations": iters, "new_tokens": tokens, "h2d_bytes_per_token": 1000.0 / b,
                         "hardware": "emulated"})
    folder = root / "batch" / "tiny_dsv2-low"
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "batch.csv", index=False)
    (folder / "batch_summary.csv").write_text(
        "method,model,memory,batch_size,status\n"
        "mo_sm,tiny_dsv2,low,4,\"refused: B=4 needs 30 MB on the device, more than the budget of 20.00 MB; "
        "the largest batch that fits is B=2\"\n")
    return root


class _Capture(Output):
    """An Output that keeps, per figure name, what its axes drew (before the figure is closed)."""

    def figure(self, fig, name: str) -> None:
        drawn = getattr(self, "drawn", {})
        drawn[name] = {
            "axes": [[(list(map(float, l.get_xdata())), list(map(float, l.get_ydata())), l.get_marker())
                      for l in ax.get_lines()] for ax in fig.axes],
            "legend": [t.get_text() for leg in fig.legends for t in leg.get_texts()],
            "text": " ".join(" ".join(t.get_text() for t in fig.texts).split()),  # wrapped lines joined
        }
        self.drawn = drawn
        super().figure(fig, name)


def _capture(tmp_path: Path) -> _Capture:
    folder = tmp_path / "figures"
    folder.mkdir(exist_ok=True)
    return _Capture(folder, dpi=40)


def test_fig16_draws_one_defined_quantity_for_every_method(tmp_path):
    """Fig. 16 is the verification working set per target pass (grows with B), for every method."""
    results = ResultSet(_batch(tmp_path / "r"))
    data = batching.load_batch(results)
    got = data.set_index(["method", "batch_size"])[batching.DEMAND]  # still in the table, not drawn
    assert got[("specter", 1)] == pytest.approx(20 * 8 / 128) and got[("mo_sm", 2)] == pytest.approx(10 * 128 / 256)
    out = _capture(tmp_path)
    batching.build(results, out)
    fig16 = out.drawn["fig16_batch_working_set"]
    lines = [(x, y) for x, y, marker in fig16["axes"][0] if marker == "o"]  # top panel: the working set
    assert sorted(lines) == sorted([([1.0, 2.0, 4.0], [20.0, 24.0, 30.0]), ([1.0, 2.0], [6.0, 10.0])])
    assert any("pass = B tokens" in t for t in fig16["legend"])  # mo_sm: one decode step of B tokens
    assert "working set: distinct experts per MoE layer in one target pass" in fig16["text"]
    assert batching.WORKING_SET in pd.read_csv(out.folder / "fig15_batch_tpot.csv").columns


def test_refused_batch_sizes_are_drawn_as_markers(tmp_path):
    out = _capture(tmp_path)
    batching.build(ResultSet(_batch(tmp_path / "r")), out)
    for name in ("fig15_batch_tpot", "fig16_batch_working_set"):
        fig = out.drawn[name]
        for panel in fig["axes"]:
            assert [x for x, _, marker in panel if marker == "x"] == [[4.0]], name  # mo_sm refused at B=4
        assert "refused: over the memory budget" in fig["legend"]
        assert "MO-SM on tiny_dsv2 low: B = 4; largest that fits: 2" in fig["text"]


def test_fig16_names_a_folder_without_the_working_set(tmp_path):
    root = _batch(tmp_path / "r")
    old = root / "batch" / "old-offload_ar"
    old.mkdir(parents=True)
    pd.DataFrame([{"method": "offload_ar", "model": "tiny_dsv2", "memory": "low", "batch_size": b, "dataset": "gsm8k",
                   "tpot_mean_ms": 20.0 + b, "throughput_tok_s": 50.0 * b, "hardware": "emulated"}
                  for b in (1, 2)]).to_csv(old / "batch.csv", index=False)  # written before the column existed
    out = _capture(tmp_path)
    batching.build(ResultSet(root), out)
    fig16 = out.drawn["fig16_batch_working_set"]
    assert "no working set in the batch.csv of: Offload-AR (not drawn)" in fig16["text"]
    assert not any(t.startswith("Offload-AR") for t in fig16["legend"])
    assert any(t.startswith("Offload-AR") for t in out.drawn["fig15_batch_tpot"]["legend"])


def test_lossy_method_is_marked_in_the_batch_legend(tmp_path):
    root = _batch(tmp_path / "r")
    folder = root / "batch" / "moe_spec"
    folder.mkdir(parents=True)
    pd.DataFrame([{"method": "moe_spec", "model": "tiny_dsv2", "memory": "low", "batch_size": b, "dataset": "gsm8k",
                   "tpot_mean_ms": 9.0, "throughput_tok_s": 90.0 * b, "distinct_experts_per_layer": 8.0 * b, "K": 4,
                   "hardware": "emulated", "token_match_fraction": m}
                  for b, m in ((1, 0.40), (2, 0.50))]).to_csv(folder / "batch.csv", index=False)
    out = _capture(tmp_path)
    batching.build(ResultSet(root), out)
    assert "MoE-Spec (lossy, 45 % tokens match)" in out.drawn["fig15_batch_tpot"]["legend"]
    assert "MoE-Spec (lossy, 45 % tokens match), pass = B×5 tokens" in out.drawn["fig16_batch_working_set"]["legend"]


def test_table3_at_the_largest_b_keeps_refused_cells(tmp_path):
    results = ResultSet(_batch(tmp_path / "r"))
    out = _out(tmp_path)
    batching.build(results, out)
    t3 = pd.read_csv(out.folder / "table3_batch.csv")
    assert set(t3["batch_size"]) == {4}
    refused = t3[t3["method"] == "mo_sm"]
    assert refused["status"].tolist() == ["refused (largest B = 2)"] and refused["tpot_ms"].isna().all()
    assert t3[(t3["method"] == "specter") & (t3["dataset"] == "AVG")]["tpot_ms"].tolist() == [15]
    md = (out.folder / "table3_batch.md").read_text()
    assert "| mo_sm | AVG | refused (largest B = 2) | refused (largest B = 2) |" in md
    scale = pd.read_csv(out.folder / "table_batch_scaling.csv").set_index("method")
    assert (scale["B_max"] == 4).all() and scale.loc["mo_sm", "status"] == "refused (largest B = 2)"
    assert pd.isna(scale.loc["mo_sm", "tpot_ratio_Bmax_B1"]) and scale.loc["specter", "tpot_ratio_Bmax_B1"] == 1.5
    assert scale.loc["mo_sm", "tpot_ratio_B2_B1"] == pytest.approx(16 / 12)
    assert "refused (largest B = 2)" in (out.folder / "table_batch_scaling.md").read_text()


# ---------------------------------------------------------------- item 9: Fig. 11 baselines


def _kernel_csv(root: Path, per_expert: bool) -> ResultSet:
    root.mkdir(parents=True)
    row = {"device": "cpu", "dtype": "bfloat16", "H": 128, "I": 128, "E": 64, "k": 6, "T": 8,
           "unfused_ms": 4.0, "grouped_ms": 2.0, "int4mm_ms": 1.0}
    if per_expert:
        row.update(grouped_per_expert_ms=6.0, int4mm_per_expert_ms=5.0)
    pd.DataFrame([row]).to_csv(root / "draft_kernel.csv", index=False)
    return ResultSet(root)


def test_fig11_sets_each_kernel_against_its_own_per_expert_calls(tmp_path):
    speed, described = draft_kernel.speedup_table(draft_kernel.long_table(_kernel_csv(tmp_path / "a", True)))
    got = speed.set_index("backend")
    assert described == "per-expert calls of the same kernel" and set(got.index) == {"grouped", "int4mm"}
    assert got.loc["grouped", "baseline"] == "grouped_per_expert" and got.loc["grouped", "speedup_geomean"] == pytest.approx(3.0)
    assert got.loc["int4mm", "baseline"] == "int4mm_per_expert" and got.loc["int4mm", "speedup_geomean"] == pytest.approx(5.0)
    old, described = draft_kernel.speedup_table(draft_kernel.long_table(_kernel_csv(tmp_path / "b", False)))
    assert described == "the `unfused` backend" and set(old["baseline"]) == {"unfused"}
    assert old.set_index("backend").loc["int4mm", "speedup_geomean"] == pytest.approx(4.0)


def test_per_expert_calls_compute_the_fused_result():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from scripts.bench_draft_kernel import Case, expert_slice, int4mm_slice, layer_weights, per_expert_calls
    from specter.kernels.draft_moe import draft_moe_fused, draft_moe_reference, prepare_int4mm

    gen = torch.Generator().manual_seed(0)
    c = Case(128, 128, 8, 2, (5,), 1)
    _, _, packed = layer_weights(c, gen, torch.device("cpu"))
    gu, dn = packed.gate_up, packed.down
    x = torch.randn(5, 128, generator=gen)  # [T, H]
    w, idx = torch.softmax(torch.randn(5, 8, generator=gen), -1).topk(2, -1)  # [T, k]
    ref = draft_moe_reference(x, idx, w, gu, dn, F.silu)  # [T, H]
    gue, dne = [expert_slice(gu, e) for e in range(8)], [expert_slice(dn, e) for e in range(8)]
    grouped = per_expert_calls(lambda xs, i, wt, e: draft_moe_fused(xs, i, wt, gue[e], dne[e], F.silu,
                                                                     backend="grouped"), x, idx, w, 8)
    torch.testing.assert_close(grouped, ref, rtol=1e-4, atol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    prepared = prepare_int4mm(gu, dn, torch.bfloat16)
    pre = [int4mm_slice(prepared, e) for e in range(8)]
    int4 = per_expert_calls(lambda xs, i, wt, e: draft_moe_fused(xs, i, wt, gue[e], dne[e], F.silu, backend="int4mm",
                                                                  prepared=pre[e]), xb, idx, wb, 8)
    fused = draft_moe_fused(xb, idx, wb, gu, dn, F.silu, backend="int4mm", prepared=prepared)
    torch.testing.assert_close(int4.float(), fused.float(), rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------- item 3: K per tier


def _sweep(root: Path, memory: str, tpots: list[float]) -> None:
    folder = root / "k_sweep" / f"tiny_dsv2-{memory}-emulated"
    folder.mkdir(parents=True)
    pd.DataFrame({"K": [4, 8, 16], "mean_tpot_ms": tpots}).to_csv(folder / "k_sweep.csv", index=False)
    best = [4, 8, 16][tpots.index(min(tpots))]
    (folder / "k_profile.json").write_text(json.dumps({"model": "tiny_dsv2", "memory": memory,
                                                       "hardware": "emulated", "K": best}))


def test_a_method_reads_its_own_profile_else_specters_else_the_swept_tier():
    profiles = {("m", "low", "specter"): (24, "interior"), ("m", "low", "specmoeoff"): (6, "interior")}
    assert k_sweep.profile_of(profiles, "m", "low", "moe_spec") == (24, "specter's profile: interior")
    assert k_sweep.profile_of(profiles, "m", "high", "specmoeoff") == (6, "specmoeoff's profile of the low tier: interior")
    assert k_sweep.profile_of(profiles, "other", "low", "specter") == (None, "no sweep for this model")
    assert k_sweep.profile_of(profiles, "m", "low", "specmoeoff_artifact") == (None, "reads no K profile (fixed K)")


def test_k_sweep_says_where_its_minimum_is_and_which_k_records_used(tmp_path):
    root = tmp_path / "r"
    _sweep(root, "high", [12.0, 9.0, 10.0])
    _sweep(root, "low", [20.0, 15.0, 11.0])
    _run(root / "main" / "spec-high", "specter", "emulated", 10.0, memory="high", K=8)
    _run(root / "main" / "spec-low", "specter", "emulated", 10.0, memory="low", K=16)
    results = ResultSet(root)
    sweeps = k_sweep.sweep_table(results)
    where = sweeps.groupby("memory")["minimum"].first().to_dict()
    assert where == {"high": "interior", "low": "edge: largest K swept (K=16)"}
    used = k_sweep.k_used_table(results).set_index("memory")
    assert used.loc["high", "K_in_records"] == "8" and used.loc["high", "profile_K"] == 8
    assert "edge" in used.loc["low", "profile"] and used.loc["low", "records_without_K"] == 0
    out = _out(tmp_path)
    k_sweep.build(results, out)
    assert (out.folder / "table_k_used.md").exists() and (out.folder / "fig07_k_sweep.png").exists()
    assert k_sweep.minimum_at(pd.DataFrame({"K": [2, 4, 8], "mean_tpot_ms": [5.0, 6.0, 7.0]})).startswith(
        "edge: smallest")


def test_batch_claims_compare_on_one_hardware(tmp_path):
    """A method measured on two hardware (or on a batch.csv that names none) is never mixed."""
    root = _batch(tmp_path / "r")
    other = root / "batch" / "elsewhere"
    other.mkdir(parents=True)
    pd.DataFrame([{"method": m, "model": "tiny_dsv2", "memory": "low", "batch_size": 2, "dataset": "gsm8k",
                   "tpot_mean_ms": 99.0, "throughput_tok_s": 1.0} for m in ("specter", "mo_sm")]).to_csv(
        other / "batch.csv", index=False)
    paper = tmp_path / "paper"
    paper.mkdir()
    (paper / "claims.csv").write_text("claim,model,method,baseline,batch_from,batch_to,value,unit,source\n"
                                      "batch_tpot_speedup,dsv2,specter,mo_sm,2,2,2.0,x,test\n")
    results = ResultSet(root, paper=paper)
    assert set(batching.load_batch(results)["hardware"]) == {"emulated", "unknown"}
    row = paper_compare.compare(results).iloc[0]
    assert row["here"] == pytest.approx(16 / 12)  # emulated rows only (first hardware of specter at B=2)


def test_routing_reads_main_grid_routes_only(tmp_path):
    """Traced runs, K-sweep points and benches repeat the main grid's prompts: their routes are not counted twice."""
    from specter.figures import routing

    root = tmp_path / "r"
    main = _run(root / "main" / "specter", "specter", "emulated", 10.0, K=16)
    traced = _run(root / "trace" / "specter", "specter", "emulated", 5.0, K=16, trace_windows=True)
    point = _run(root / "k_sweep" / "x" / "K=4", "specter", "emulated", 5.0, K=4)
    cols = ["dataset", "prompt_index", "repeat", "window", "layer", "expert", "count"]
    for folder in (main, traced, point):
        pd.DataFrame([("humaneval", 0, 0, 0, 1, 3, 1)], columns=cols).to_csv(folder / "routes.csv", index=False)
    routes = routing.load_routes(ResultSet(root))
    assert routes["run"].tolist() == ["main/specter"]


def test_settings_that_differ_between_cells_split_nothing(tmp_path):
    """A setting that differs between tiers by design (e.g. staging chosen per tier) keeps one name."""
    root = tmp_path / "r"
    _run(root / "high", "specter", "emulated", 10.0, memory="high", staging_buffers=8)
    _run(root / "low", "specter", "emulated", 20.0, memory="low", staging_buffers=2)
    _run(root / "low-none", "specter", "emulated", 30.0, memory="low", staging_buffers=0)
    main = ResultSet(root).records("main")
    by_tier = main.groupby("memory")["variant"].agg(lambda v: sorted(set(v))).to_dict()
    assert by_tier == {"high": ["specter"],
                       "low": ["specter[staging_buffers=0]", "specter[staging_buffers=2]"]}


def test_two_depths_in_one_cell_are_two_variants(tmp_path):
    root = tmp_path / "r"
    _run(root / "k8", "specter", "emulated", 10.0, K=8)
    _run(root / "k16", "specter", "emulated", 20.0, K=16)
    _run(root / "other-tier", "specter", "emulated", 20.0, memory="low", K=16)
    main = ResultSet(root).records("main")
    assert set(main[main["memory"] == "high"]["variant"]) == {"specter[K=8]", "specter[K=16]"}
    assert set(main[main["memory"] == "low"]["variant"]) == {"specter"}


# ---------------------------------------------------------------- item 1: what staging buffers buy
def test_staging_ablation_is_drawn_apart_and_compared_per_method(tmp_path):
    """The ablation runs (method.staging_buffers=0 under ablation/staging0) never split the main grid's
    method, and fig_staging_ablation reads each method's gain beside its own main run."""
    from specter.figures import staging

    root = _grid(tmp_path / "results")
    _run(root / "ablation" / "staging0" / "specter", "specter", "emulated", 15.0, K=16, prefetch="adaptive",
         trace_windows=False, staging_buffers=0)
    _run(root / "ablation" / "staging0" / "offload_ar", "offload_ar", "emulated", 33.0, staging_buffers=0)
    results = ResultSet(root)
    assert set(results.records("main")["variant"]) == {"specter", "offload_ar", "transformers", "target_only"}
    table = staging.staging_table(results).set_index("method")
    assert set(table.index) == {"specter", "offload_ar"}
    assert table.loc["specter", "gain"] == pytest.approx(15.5 / 10.5)  # medians: 15+{0,1} over 10+{0,1}
    assert table.loc["offload_ar", "gain"] == pytest.approx(33.5 / 30.5)
    out = _out(tmp_path)
    staging.build(results, out)
    assert (out.folder / f"{staging.NAME}.png").exists() and (out.folder / f"{staging.NAME}.csv").exists()


def test_batch_row_carries_a_lossy_methods_token_match():
    from types import SimpleNamespace

    from specter.experiments.batch import batch_row

    def request(match):
        clock = SimpleNamespace(latency=lambda: {"tpot_ms": 10.0, "ttft_ms": 50.0})
        stats = {} if match is None else {"token_match_fraction": match}
        return SimpleNamespace(clock=clock, tokens=[1, 2, 3], stats=stats)

    def run(*matches):
        return SimpleNamespace(requests=[request(m) for m in matches], wall_seconds=lambda: 1.0,
                               stats={"iterations": 3, "distinct_experts_per_layer": 7.0})

    assert batch_row([run(0.4, 0.6), run(0.2)])["token_match_fraction"] == pytest.approx(0.4)
    assert batch_row([run(None)])["token_match_fraction"] is None  # a lossless method leaves it empty


def test_k_minimum_at_the_memory_limit_is_not_a_range_edge():
    """A sweep whose larger K the tier refused ends at memory, not at a range a user could widen."""
    sweep = pd.DataFrame({"K": [4, 8, 16, 32], "mean_tpot_ms": [9.0, 8.0, 7.0, 6.0]})
    assert k_sweep.minimum_at(sweep) == "edge: largest K swept (K=32)"
    assert k_sweep.minimum_at(sweep, refused=["48", "64"]) == "edge: largest K the memory tier holds (K=32; K=48,64 refused)"
    inner = sweep.assign(mean_tpot_ms=[9.0, 6.0, 7.0, 8.0])
    assert k_sweep.minimum_at(inner, refused=[48]) == "interior"
