"""Every figure make_figures writes reads at 1,600 px: drawn at the default dpi from a synthetic result
set as wide as the real one (three models, long variant labels, refused batch sizes), each PNG is at
most MAX_WIDTH_PX wide; and the legend-label helpers say what a reader needs (lossy methods marked)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_figures import RECORD_COLUMNS, make_figures, make_results  # noqa: E402

from specter.figures.common import MAX_WIDTH_PX, legend_above, subplots  # noqa: E402
from specter.figures.labels import compact_variants, legend_label, split_variant, token_match_of  # noqa: E402

MODELS = ("tiny_dsv2", "tiny_qwen", "tiny_phi")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header (IHDR), without an image library."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def _config(folder: Path, model: str, method: str, memory: str, **settings) -> None:
    extra = "".join(f"  {k}: {v}\n" for k, v in settings.items())
    (folder / "config.yaml").write_text(
        f"model:\n  name: {model}\nmemory:\n  name: {memory}\nmethod:\n  name: {method}\n{extra}"
        "hardware:\n  name: emulated\ndataset:\n  name: all\n")


def _records(folder: Path, model: str, method: str, memory: str = "low", **settings) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _config(folder, model, method, memory, **settings)
    rows = [[method, model, memory, "gsm8k", i, 0, "emulated", 16, 32, 10.0 + i, 30, 32, 0.9, 300, 200, 1, "x"]
            for i in range(2)]
    pd.DataFrame(rows, columns=RECORD_COLUMNS).to_csv(folder / "records.csv", index=False)


def make_wide(root: Path) -> Path:
    """make_results' set plus two more models in every figure with one panel per model."""
    make_results(root)
    for model in MODELS:
        # I/O vs oracle: five variants per model whose settings differ in several keys (long raw labels)
        for prefetch in ("adaptive", "late", "none", "oracle"):
            _records(root / "bench" / "prefetch" / f"{model}-specter-{prefetch}", model, "specter",
                     prefetch=prefetch, decode_path="fused_int4_grouped_gemm", staging_buffers=4)
        _records(root / "bench" / "prefetch" / f"{model}-offload_ar", model, "offload_ar",
                 decode_path="eager_loop_per_expert", staging_per_layer=2)
        # the staging ablation's runs differ in more keys; drawn apart, they still lengthen the raw labels
        _records(root / "ablation" / "staging0" / f"{model}-specter", model, "specter", prefetch="adaptive",
                 staging_buffers=0)
        _records(root / "ablation" / "staging0" / f"{model}-offload_ar", model, "offload_ar", staging_buffers=0)
    rows, refused = [], []
    for model in MODELS[1:]:
        for method, k in (("specter", 16), ("specmoeoff", 3), ("mo_sm", None), ("moe_spec", 8)):
            for b in (1, 2, 4, 8, 16, 32):
                if method == "specmoeoff" and b >= 16:
                    refused.append((method, model, b))
                    continue
                rows.append({"method": method, "model": model, "memory": "high", "batch_size": b, "dataset": "gsm8k",
                             "tpot_mean_ms": 10.0 + b, "throughput_tok_s": 50.0 * b, "K": k, "hardware": "emulated",
                             "distinct_experts_per_layer": 5.0 + b, "h2d_bytes_per_token": 1e6 / b,
                             "token_match_fraction": 0.45 if method == "moe_spec" else None})
    batch = root / "batch" / "wide"
    batch.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(batch / "batch.csv", index=False)
    pd.DataFrame([{"method": m, "model": mo, "memory": "high", "batch_size": b,
                   "status": f"refused: B={b} needs more than the budget; the largest batch that fits is B=14"}
                  for m, mo, b in refused]).to_csv(batch / "batch_summary.csv", index=False)
    pd.DataFrame({"model": [m for m in MODELS for _ in range(3)], "memory": "low", "K": [4, 8, 16] * 3,
                  "expert_wise_ms": 1.0, "token_wise_ms": [2.0, 3.0, 4.0] * 3, "speedup": [2.0, 3.0, 4.0] * 3}).to_csv(
        root / "bench" / "verify_schedule.csv", index=False)
    pd.DataFrame([{"model": model, "memory": tier, "hardware": "emulated", "method": m, "load_ratio": r,
                   "tpot_ms": 5.0 + r * (4 if m == "offload_ar" else 1), "effective_load_ratio": r * 1.1,
                   "load_ratio_off": 0}
                  for model in MODELS for tier in ("high", "low") for r in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
                  for m in ("offload_ar", "specter", "specmoeoff", "mo_sm")]).to_csv(
        root / "load_ratio" / "load_ratio.csv", index=False)
    return root


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    results = make_wide(root / "results")
    res = subprocess_figures(results, root / "figures")
    return root / "figures", res


def subprocess_figures(results: Path, figures: Path):
    # make_figures at its default dpi (the test helper's --dpi 60 is overridden by the last flag)
    return make_figures(results, figures, "--dpi", "150")


def test_every_figure_fits_1600_px(wide):
    figures, res = wide
    pngs = sorted(figures.glob("*.png"))
    assert len(pngs) >= 12, res.stdout
    too_wide = {p.name: png_size(p)[0] for p in pngs if png_size(p)[0] > MAX_WIDTH_PX}
    assert not too_wide, too_wide


def test_io_vs_oracle_names_variants_by_what_differs(wide):
    table = pd.read_csv(wide[0] / "io_vs_oracle.csv")
    assert set(table.loc[table["model"] == "tiny_qwen", "method"]) == {
        "offload_ar", "specter[prefetch=adaptive]", "specter[prefetch=late]", "specter[prefetch=none]",
        "specter[prefetch=oracle]"}
    assert table["variant"].str.contains("decode_path").any()  # the CSV keeps the full label


def test_a_legend_wider_than_its_figure_takes_fewer_columns():
    fig, _ = subplots(1, 2, w=2.0, h=2.0)
    labels = [f"a rather long legend label number {i}" for i in range(6)]
    legend_above(fig, [fig.axes[0].plot([], [])[0] for _ in labels], labels)
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[-1]
    assert legend.get_window_extent(renderer).width <= fig.bbox.width
    assert len(fig.legends) == 1  # the too-wide tries are removed


def test_many_panels_are_narrowed_to_the_width_limit():
    fig, axes = subplots(2, 6, w=3.6)
    assert fig.get_figwidth() * 150 <= MAX_WIDTH_PX and axes.shape == (2, 6)


def test_legend_label_marks_lossy_methods():
    assert legend_label("specter") == "Specter"
    assert legend_label("moe_spec", 0.452) == "MoE-Spec (lossy, 45 % tokens match)"
    assert legend_label("moe_spec") == "MoE-Spec (lossy)" and legend_label("moe_spec", float("nan")) == "MoE-Spec (lossy)"
    assert legend_label("moe_spec[budget=4]", 0.5) == "MoE-Spec (budget=4; lossy, 50 % tokens match)"
    assert legend_label("specter[method.prefetch=none]") == "Specter (prefetch=none)"
    assert legend_label("zeta_offload", 0.1) == "zeta_offload"  # token match alone does not make a method lossy


def test_split_and_compact_variants():
    assert split_variant("specter[K=16,sizes=[1, 2],prefetch=none]") == (
        "specter", {"K": "16", "sizes": "[1, 2]", "prefetch": "none"})
    t = pd.DataFrame({"model": ["a", "a", "b", "b", "a"], "memory": "low",
                      "method": ["specter[K=16,p=x]", "specter[K=16,p=y]", "specter[K=8,p=x]", "specter[K=8,p=y]",
                                 "offload_ar[d=None]"]})
    assert compact_variants(t).tolist() == ["specter[p=x]", "specter[p=y]", "specter[p=x]", "specter[p=y]",
                                            "offload_ar"]


def test_token_match_of_averages_the_records_that_carry_one():
    records = pd.DataFrame({"method": ["moe_spec", "moe_spec", "moe_spec", "specter"],
                            "token_match_fraction": [0.4, 0.5, None, None]})
    assert token_match_of(records) == {"moe_spec": pytest.approx(0.45)}
    assert token_match_of(pd.DataFrame({"method": ["a"]})) == {}
