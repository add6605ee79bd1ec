"""Time the INT4 draft MoE: reference vs fused backends vs an FP per-expert loop.

    python scripts/bench_draft_kernel.py                      # full grid, CSV to results/bench/draft_kernel.csv
    python scripts/bench_draft_kernel.py --quick --dtype float32 out.csv

For every (H, I, E, k, T) it times, after warm-up, the median of `--reps` calls of:
  reference  dequantize all experts + HF eager loop        (draft_moe_reference)
  unfused    HF eager loop, dequantizing each active expert on use (draft_moe_unfused)
  grouped    sort + dequantize active + grouped GEMM       (draft_moe_fused, backend="grouped")
  int4mm     dense over active experts, torch CPU INT4 GEMM (backend="int4mm", prepared weights)
  auto       whatever draft_moe_fused picks by default
  fp_loop    HF eager loop on FP weights already in x.dtype (no quantization at all)
and prints speedup ratios (reference / method, fp_loop / method). CUDA timings use events.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specter.kernels.draft_moe import (DequantWorkspace, draft_moe_fused, draft_moe_reference,  # noqa: E402
                                       draft_moe_unfused, moe_eager_loop, prepare_int4mm)
from specter.quant.int4 import quantize_rtn  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
METHODS = ("reference", "unfused", "grouped", "int4mm", "auto", "fp_loop")


def median_ms(fn: Callable[[], object], warmup: int, reps: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_case(h: int, i: int, e: int, k: int, t: int, dtype: torch.dtype, device: torch.device,
               warmup: int, reps: int, gen: torch.Generator, skip: set[str]) -> dict[str, float]:
    gu_fp = torch.randn(e, 2 * i, h, generator=gen) / h**0.5  # [E, 2I, H]
    dn_fp = torch.randn(e, h, i, generator=gen) / i**0.5  # [E, H, I]
    gu, dn = quantize_rtn(gu_fp, 128).to(device), quantize_rtn(dn_fp, 128).to(device)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w, idx = torch.softmax(torch.randn(t, e, generator=gen), -1).topk(k, -1)  # [T, k]
    w, idx = w.to(device, dtype), idx.to(device)
    gu_d, dn_d = gu_fp.to(device, dtype), dn_fp.to(device, dtype)
    ws = DequantWorkspace()
    prepared = prepare_int4mm(gu, dn, dtype) if device.type == "cpu" else None
    fns: dict[str, Callable[[], object]] = {
        "reference": lambda: draft_moe_reference(x, idx, w, gu, dn, F.silu),
        "unfused": lambda: draft_moe_unfused(x, idx, w, gu, dn, F.silu),
        "grouped": lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="grouped", workspace=ws),
        "auto": lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, prepared=prepared, workspace=ws),
        "fp_loop": lambda: moe_eager_loop(x, idx, w, gu_d, dn_d, F.silu),
    }
    if prepared is not None:
        fns["int4mm"] = lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="int4mm", prepared=prepared)
    with torch.inference_mode():
        # the reference dequantizes every expert: fewer repetitions keep the grid affordable
        return {name: median_ms(fn, min(warmup, 1) if name == "reference" else warmup,
                                max(3, reps // 5) if name == "reference" else reps, device)
                for name, fn in fns.items() if name not in skip}


# (numerator, denominator): "a/b" > 1 means b is faster than a
RATIOS = (("reference", "auto"), ("unfused", "auto"), ("unfused", "grouped"), ("fp_loop", "auto"),
          ("fp_loop", "grouped"), ("fp_loop", "int4mm"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default="results/bench/draft_kernel.csv", help="output CSV path")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 60, 64])
    ap.add_argument("--topk", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--dims", nargs="+", default=["128x128", "512x512"], help="HxI pairs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch's default; 1 avoids OpenMP waits on shared machines)")
    ap.add_argument("--skip", nargs="*", default=[], choices=METHODS, help="methods not to time")
    ap.add_argument("--quick", action="store_true", help="small grid: T in {1,8,64}, E=64, k in {2,6}")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.experts, args.topk = [1, 8, 64], [64], [2, 6]
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} (median ms; ratios a/b > 1: b faster)")
    print(f"{'H':>4} {'I':>4} {'E':>3} {'k':>2} {'T':>3} " + " ".join(f"{m:>9}" for m in METHODS) + " "
          + " ".join(f"{a[:5] + '/' + b[:6]:>13}" for a, b in RATIOS))
    for dims in args.dims:
        h, i = (int(v) for v in dims.lower().split("x"))
        for e in args.experts:
            for k in args.topk:
                for t in args.tokens:
                    ms = bench_case(h, i, e, k, t, dtype, device, args.warmup, args.reps, gen, set(args.skip))
                    row: dict[str, object] = {"device": str(device), "dtype": args.dtype,
                                              "threads": torch.get_num_threads(), "H": h, "I": i, "E": e, "k": k,
                                              "T": t}
                    row.update({f"{m}_ms": ms.get(m, float("nan")) for m in METHODS})
                    ratios = [ms.get(a, float("nan")) / ms.get(b, float("nan")) for a, b in RATIOS]
                    row.update({f"{a}_over_{b}": r for (a, b), r in zip(RATIOS, ratios)})
                    rows.append(row)
                    print(f"{h:>4} {i:>4} {e:>3} {k:>2} {t:>3} "
                          + " ".join(f"{ms.get(m, float('nan')):>9.3f}" for m in METHODS) + " "
                          + " ".join(f"{r:>13.2f}" for r in ratios), flush=True)
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
