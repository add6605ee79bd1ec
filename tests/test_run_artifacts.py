"""A run folder keeps the target's routes (Fig. 13) and, on request, every window's trace (Figs. 8/9)."""

from __future__ import annotations

import pandas as pd

from conftest import compose


def test_routes_and_trace_are_written_per_record(tiny_checkpoint, tmp_path):
    from specter.experiments.run import run

    tiny_checkpoint("tiny_dsv2")
    out = tmp_path / "run"
    cfg = compose(["model=tiny_dsv2", "method=specter", "method.quant=rtn", "memory=low", "hardware=emulated",
                   "hardware.bandwidth_gbps=1", "K=4", "num_prompts=2", "max_new_tokens=10", "warmup_tokens=0",
                   "progress=false", "method.trace_windows=true", f"output_dir={out}"])
    run(cfg)
    assert not (out / "routes.csv").exists() and not (out / "trace.csv").exists()  # the bulky logs: compressed
    routes = pd.read_csv(out / "routes.csv.gz")
    records = pd.read_csv(out / "records.csv")
    assert set(routes.prompt_index) == {0, 1}
    assert list(routes.columns[:7]) == ["dataset", "prompt_index", "repeat", "window", "layer", "expert", "count"]
    # every window's route counts add up to (positions x top-k) per layer: 6 routes per token for DSV2
    per_window = routes.groupby(["prompt_index", "window", "layer"])["count"].sum()
    assert (per_window % 6 == 0).all()
    trace = pd.read_csv(out / "trace.csv.gz")
    assert {"draft", "verify", "moe", "compute"} <= set(trace.event)
    assert (trace.end_ms >= trace.start_ms).all()
    copies = trace[trace.event == "copy"]
    assert len(copies) > 0 and copies.bytes.gt(0).all()
    assert len(records) == 2
