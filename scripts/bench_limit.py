"""How close Specter gets to the pipeline limit, window by window (per-window traces).

For every (model, memory tier) it runs Specter through the emulated link with window tracing on,
computes each window's lower bound under the same slots, draft and link
(`specter.speculative.trace.window_limits`), and reports `specter / limit` with where the
difference goes:

    python -m scripts.bench_limit                               # trained tiny models, both tiers
    python -m scripts.bench_limit --models tiny_phi --memory low --num-prompts 2 --max-new-tokens 64

Writes results/bench/limit.csv (one row per model x tier: sums over windows), limit_windows.csv
(one row per window) and trace_<model>_<tier>.csv (every event: draft, boundary, copy, moe layer,
expert wait/compute), which make_figures.py draws as the planner timeline.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pandas as pd
import torch

from specter.assembly.compose import compose

REPO = Path(__file__).resolve().parents[1]


def measure(model: str, memory: str, args) -> tuple[list[dict], list[dict], dict]:
    from transformers import AutoTokenizer

    from specter.datasets import load_prompts
    from specter.assembly.methods import build_method
    from specter.assembly.runtime import model_checkpoint
    from specter.speculative.sampling import make_generator
    from specter.speculative.trace import window_limits

    overrides = [f"model={model}", f"memory={memory}", "method=specter", f"hardware={args.hardware}",
                 f"model.trained={not args.untrained}", "method.trace_windows=true", *args.override]
    cfg = compose(overrides)
    torch.set_num_threads(int(cfg.hardware.threads or torch.get_num_threads()))
    checkpoint = model_checkpoint(cfg)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompts = load_prompts(args.dataset, args.num_prompts, cfg.assets_dir, allow_hub=False)
    method = build_method(cfg, checkpoint)
    windows, events = [], []
    try:
        encode = lambda text: torch.tensor([tok(text, add_special_tokens=False).input_ids[:16]])  # noqa: E731
        method.generate(encode(prompts[0]), 32, make_generator("cpu", 0))  # warm-up
        method.warmed()
        engine = method.engine
        load_ms = method.rt.link.transfer_seconds(method.rt.om.store.nbytes_per_expert) * 1e3 \
            if hasattr(method.rt.link, "transfer_seconds") else 0.0
        tpots = []
        for i, text in enumerate(prompts):
            method.reset()
            gen = method.generate(encode(text), args.max_new_tokens, make_generator("cpu", i))
            tpots.append(gen.clock.latency()["tpot_ms"])
            for row in window_limits(engine.tracer, engine.plan_capacity, load_ms):
                windows.append({"model": model, "memory": memory, "record": i, **row})
            events += [{"model": model, "memory": memory, "record": i, **e} for e in engine.tracer.rows()]
    finally:
        method.close()
    w = pd.DataFrame(windows)
    summary = {
        "model": model, "memory": memory, "K": method.K, "M": method.rt.resident,
        "tpot_ms": statistics.median(tpots), "windows": len(w),
        "actual_ms": w.actual_ms.sum(), "limit_ms": w.limit_ms.sum(),
        "specter_over_limit": w.actual_ms.sum() / w.limit_ms.sum(),
        "draft_ms": w.draft_ms.sum(), "verify_compute_ms": w.verify_compute_ms.sum(),
        "verify_wait_ms": w.verify_wait_ms.sum(), "link_idle_in_draft_ms": w.link_idle_in_draft_ms.sum(),
        "copy_queued_ms": w.copy_queued_ms.sum(), "expert_load_ms": load_ms,
        "staging_buffers": method.rt.cache.staging,
    }
    return windows, events, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen", "tiny_phi"])
    ap.add_argument("--memory", nargs="+", default=["high", "low"])
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--hardware", default="emulated")
    ap.add_argument("--untrained", action="store_true", help="random-weight tiny models (degenerate text)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    ap.add_argument("override", nargs="*", help="extra config overrides, e.g. method.quant=rtn K=8")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries, all_windows = [], []
    for model in args.models:
        for memory in args.memory:
            windows, events, summary = measure(model, memory, args)
            pd.DataFrame(events).to_csv(out / f"trace_{model}_{memory}.csv", index=False)
            all_windows += windows
            summaries.append(summary)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()}, flush=True)
    table = pd.DataFrame(summaries)
    table.to_csv(out / "limit.csv", index=False)
    pd.DataFrame(all_windows).to_csv(out / "limit_windows.csv", index=False)
    cols = ["model", "memory", "K", "M", "staging_buffers", "tpot_ms", "specter_over_limit", "draft_ms", "verify_compute_ms",
            "verify_wait_ms", "link_idle_in_draft_ms", "copy_queued_ms"]
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out / 'limit.csv'}, {out / 'limit_windows.csv'}, {out}/trace_*.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
