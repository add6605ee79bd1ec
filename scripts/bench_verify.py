"""Verification of K tokens: expert-wise vs token-wise MoE schedule through the offloaded cache.

For each tiny model and memory tier: prefill a 16-token prompt, then time one target forward of
K+1 tokens (the verification pass) with the expert cache reset to its initial residents before
every repetition, once grouping tokens per expert (resident experts first, misses as they land)
and once token by token. Prints medians and the speedup, writes a CSV.

    python scripts/bench_verify.py                     # emulated link, K in 4 8 16
    python scripts/bench_verify.py --models tiny_dsv2 --K 16 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]

from specter.assembly.compose import compose


def time_verification(rt, prompt: torch.Tensor, window: torch.Tensor, schedule: str, reps: int) -> dict:
    from specter.moe import MoERuntime, TargetExecutor
    from specter.speculative.state import SequenceKV

    moe = MoERuntime(TargetExecutor(rt.cache, schedule)).attach(rt.om.experts.values())  # this schedule's executor
    times, loads = [], []
    try:
        with torch.inference_mode(), moe.mode("target"):
            for _ in range(reps):
                rows = SequenceKV(rt.model)
                rows.run(rows.prefill_inputs([prompt], 0)[0])
                rt.cache.reset()  # same starting residents every repetition, outside timing
                t = time.perf_counter()
                rows.run(window)
                times.append(time.perf_counter() - t)
                loads.append(rt.cache.snapshot_counters()["loads"])
    finally:
        rt.moe.attach(rt.om.experts.values())
    return {"ms": statistics.median(times) * 1e3, "loads": statistics.median(loads)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen", "tiny_phi"])
    ap.add_argument("--memory", nargs="+", default=["high", "low"])
    ap.add_argument("--K", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--hardware", default="emulated")
    ap.add_argument("--untrained", action="store_true")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "verify_schedule.csv"))
    args = ap.parse_args(argv)

    from specter.assembly.runtime import build_runtime, method_spec, model_checkpoint

    rows = []
    for model in args.models:
        for memory in args.memory:
            cfg = compose([f"model={model}", f"memory={memory}", "method=offload_ar", f"hardware={args.hardware}",
                           f"model.trained={not args.untrained}"])
            torch.set_num_threads(int(cfg.hardware.threads or torch.get_num_threads()))
            rt = build_runtime(method_spec(cfg), model_checkpoint(cfg))
            g = torch.Generator().manual_seed(0)
            vocab = rt.model.config.vocab_size
            prompt = torch.randint(2, vocab, (1, 16), generator=g)
            for K in args.K:
                window = torch.randint(2, vocab, (1, K + 1), generator=g)
                ew = time_verification(rt, prompt, window, "expert", args.reps)
                tw = time_verification(rt, prompt, window, "token", args.reps)
                rows.append({"model": model, "memory": memory, "K": K, "M": rt.resident,
                             "expert_wise_ms": ew["ms"], "token_wise_ms": tw["ms"],
                             "speedup": tw["ms"] / ew["ms"], "expert_wise_loads": ew["loads"],
                             "token_wise_loads": tw["loads"]})
                print(rows[-1], flush=True)
            rt.close()
    table = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
