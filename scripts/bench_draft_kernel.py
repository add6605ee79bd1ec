"""Time the INT4 draft MoE backends side by side: the data of Figs. 10 (latency) and 11 (speedup).

    python scripts/bench_draft_kernel.py                       # CPU: tiny grid + real expert shapes
    python scripts/bench_draft_kernel.py --quick --dtype float32 out.csv
    python scripts/bench_draft_kernel.py --device cuda         # GPU: real shapes, decode and prefill T
    python scripts/bench_draft_kernel.py out_marlin.csv --device cuda --dims --only marlin triton

Backends (one `<name>_ms` column each; NaN where a backend cannot run on the device):
  reference      dequantize all experts + HF eager loop            (draft_moe_reference; small shapes only)
  unfused        HF eager loop, dequantizing each active expert      (draft_moe_unfused): Fig. 11's baseline
  grouped        sort + dequantize active experts + grouped GEMM     (draft_moe_fused backend="grouped")
  int4mm         dense over active experts, torch's CPU INT4 GEMM    (backend="int4mm"; CPU only)
  torch          what draft_kernel=torch runs                        (draft_moe_fused backend="auto")
  triton         two fused Triton launches, INT4 unpacked in-kernel  (triton_moe.fused_moe_w4a16; CUDA only)
  triton_kmajor  the same on N-contiguous weight storage             (triton_moe.kmajor_layout)
  marlin         gptqmodel's Marlin GEMM per active expert           (marlin_moe; CUDA, --marlin or --only)
  fp_loop        HF eager loop on FP weights in x.dtype: the FP16 baseline, no quantization
  <b>_per_expert  for b in grouped, int4mm, triton: the same kernel called once per active expert on
                 that expert's tokens (`per_expert_calls`), i.e. unfused INT4 calls of that kernel:
                 Fig. 11's baseline for backend b (speedup = <b>_per_expert_ms / <b>_ms)

Shapes: the tiny grid (H×I 128×128 and 512×512, E ∈ {16, 60, 64}, top-k ∈ {2, 4, 6}) and the
real models' experts — DeepSeek-V2-Lite 2048×1408 (E 64, top-6), Qwen1.5-MoE 2048×1408 (E 60,
top-4), Phi-3.5-MoE 4096×6400 (E 16, top-2) — at T ∈ {1, 4} on a CPU (--reps / 3 calls), and at
decode and prefill T ∈ {1, 4, 16, 64, 256, 1024} on a GPU. Every time is the median of --reps
calls after --warmup calls (CUDA: device events per call).

One dtype on both sides of every ratio: every backend takes activations in --dtype and computes
in it (INT4 paths dequantize to it, fp_loop holds its FP weights in it); each backend's output
dtype is checked once per point before timing, and the CSV's `dtype` column names it.
"""
from __future__ import annotations

import argparse
import csv
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specter.kernels.draft_moe import (DequantWorkspace, Int4mmWeights, draft_moe_fused,  # noqa: E402
                                       draft_moe_reference, draft_moe_unfused, prepare_int4mm)
from specter.kernels.reference import moe_reference
from specter.quant.int4 import Int4ExpertLayer, Int4Experts, default_group_size, quantize_rtn  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PER_EXPERT = ("grouped", "int4mm", "triton")  # fused backends timed against per-expert calls of themselves
METHODS = ("reference", "unfused", "grouped", "int4mm", "torch", "triton", "triton_kmajor", "marlin", "fp_loop",
           *(f"{b}_per_expert" for b in PER_EXPERT))
# (numerator, denominator): "a/b" > 1 means b is faster than a
RATIOS = (("grouped_per_expert", "grouped"), ("int4mm_per_expert", "int4mm"), ("triton_per_expert", "triton"),
          ("unfused", "torch"), ("unfused", "triton"), ("fp_loop", "torch"), ("fp_loop", "triton"),
          ("fp_loop", "int4mm"), ("marlin", "triton"))
REAL_SHAPES = ((2048, 1408, 64, 6), (2048, 1408, 60, 4), (4096, 6400, 16, 2))  # (H, I, E, top-k) of the paper's models
REFERENCE_MAX_WEIGHTS = 64 * 3 * 512 * 512  # the reference dequantizes every expert per call: small shapes only


def expert_slice(packed: Int4Experts, e: int) -> Int4Experts:
    """Expert e of a layer's INT4 projection as a one-expert Int4Experts (views, no copy)."""
    return Int4Experts(packed.qweight[e:e + 1], packed.scales[e:e + 1], packed.group_size)


def int4mm_slice(prepared: Int4mmWeights, e: int) -> Int4mmWeights:
    """Expert e of int4mm-layout weights as a one-expert Int4mmWeights (views, no copy)."""
    return replace(prepared, gate_up=prepared.gate_up[e:e + 1], gate_up_sz=prepared.gate_up_sz[e:e + 1],
                   down=prepared.down[e:e + 1], down_sz=prepared.down_sz[e:e + 1])


def per_expert_calls(call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
                     x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Unfused MoE: one call of a fused kernel per active expert, on the tokens routed to it.

    `call(xs [n, H], idx [n, 1] (all 0), w [n, 1], e)` runs the kernel on expert e alone; the
    outputs are summed per token in ascending expert order. The same result as one fused call
    (up to summation order), with one launch (and one host sync) per active expert."""
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_idx).tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.where(topk_idx == e)  # [n] each
        zeros = torch.zeros(tok.numel(), 1, dtype=topk_idx.dtype, device=x.device)  # [n, 1]
        y = call(x[tok], zeros, topk_w[tok, slot].unsqueeze(1), e)  # [n, H]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


@dataclass(frozen=True)
class Case:
    h: int
    i: int
    e: int
    k: int
    tokens: tuple[int, ...]
    reps: int


def median_ms(fn: Callable[[], object], warmup: int, reps: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
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


def available_methods(device: torch.device, dtype: torch.dtype, wanted: set[str]) -> dict[str, str]:
    """method -> "" if it runs here, else why not (printed once)."""
    from specter.kernels.select import triton_unavailable

    why: dict[str, str] = {}
    for m in wanted:
        reason = None
        if m == "int4mm" and device.type != "cpu":
            reason = "torch's INT4 GEMM used here is CPU only"
        elif m in ("int4mm", "int4mm_per_expert") and device.type != "cpu":
            reason = "torch's INT4 GEMM used here is CPU only"
        elif m in ("triton", "triton_kmajor", "triton_per_expert"):
            reason = triton_unavailable(device, dtype)
        elif m == "marlin":
            from specter.kernels.marlin_moe import marlin_unavailable

            reason = marlin_unavailable(device, dtype)
        why[m] = reason or ""
    return why


def layer_weights(c: Case, gen: torch.Generator, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, Int4ExpertLayer]:
    """Random FP experts on `device` and their RTN INT4 packing (quantized 8 experts at a time)."""
    gu_fp = (torch.randn(c.e, 2 * c.i, c.h, generator=gen) / c.h**0.5).to(device)  # [E, 2I, H]
    dn_fp = (torch.randn(c.e, c.h, c.i, generator=gen) / c.i**0.5).to(device)  # [E, H, I]

    def pack(w: torch.Tensor) -> Int4Experts:
        gs = default_group_size(w.shape[-1])
        parts = [quantize_rtn(w[j:j + 8], gs) for j in range(0, w.shape[0], 8)]  # bounded temporaries
        return Int4Experts(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), gs)

    return gu_fp, dn_fp, Int4ExpertLayer(pack(gu_fp), pack(dn_fp))


def bench_shape(c: Case, dtype: torch.dtype, device: torch.device, methods: set[str], warmup: int, reps: int,
                gen: torch.Generator) -> list[dict[str, float]]:
    """One weight set (H, I, E), every T: {method: median ms} per T."""
    gu_fp, dn_fp, packed = layer_weights(c, gen, device)
    gu, dn = packed.gate_up, packed.down
    methods = set(methods)
    if c.e * 3 * c.h * c.i > REFERENCE_MAX_WEIGHTS:
        methods.discard("reference")
    gu_d = dn_d = None
    if "fp_loop" in methods:
        gu_d, dn_d = gu_fp.to(device, dtype), dn_fp.to(device, dtype)
    del gu_fp, dn_fp
    prepared = prepare_int4mm(gu, dn, dtype) if {"int4mm", "int4mm_per_expert", "torch"} & methods \
        and device.type == "cpu" else None
    gu_e = [expert_slice(gu, e) for e in range(c.e)]
    dn_e = [expert_slice(dn, e) for e in range(c.e)]
    prepared_e = [int4mm_slice(prepared, e) for e in range(c.e)] if prepared is not None else None
    kmajor = marlin = None
    if "triton_kmajor" in methods:
        from specter.kernels.triton_moe import kmajor_layout

        kmajor = (kmajor_layout(gu), kmajor_layout(dn))
    if "marlin" in methods:
        from specter.kernels.marlin_moe import prepare_marlin

        marlin = prepare_marlin(Int4ExpertLayer(gu, dn), dtype, device)
    ws, ws_pe = DequantWorkspace(), DequantWorkspace()
    out = []
    for t in c.tokens:
        x = torch.randn(t, c.h, generator=gen).to(device, dtype)
        w, idx = torch.softmax(torch.randn(t, c.e, generator=gen), -1).topk(c.k, -1)  # [T, k]
        w, idx = w.to(device, dtype), idx.to(device)
        fns: dict[str, Callable[[], object]] = {
            "reference": lambda: draft_moe_reference(x, idx, w, gu, dn, F.silu),
            "unfused": lambda: draft_moe_unfused(x, idx, w, gu, dn, F.silu),
            "grouped": lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="grouped", workspace=ws),
            "torch": lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, prepared=prepared, workspace=ws),
            "fp_loop": lambda: moe_reference(x, idx, w, gu_d, dn_d, F.silu),
            "grouped_per_expert": lambda: per_expert_calls(
                lambda xs, i, wt, e: draft_moe_fused(xs, i, wt, gu_e[e], dn_e[e], F.silu, backend="grouped",
                                                     workspace=ws_pe), x, idx, w, c.e),
        }
        if prepared is not None:
            fns["int4mm"] = lambda: draft_moe_fused(x, idx, w, gu, dn, F.silu, backend="int4mm", prepared=prepared)
            fns["int4mm_per_expert"] = lambda: per_expert_calls(
                lambda xs, i, wt, e: draft_moe_fused(xs, i, wt, gu_e[e], dn_e[e], F.silu, backend="int4mm",
                                                     prepared=prepared_e[e]), x, idx, w, c.e)
        if {"triton", "triton_per_expert"} & methods or kmajor is not None:
            from specter.kernels.triton_moe import fused_moe_w4a16

            fns["triton"] = lambda: fused_moe_w4a16(x, idx, w, gu, dn, F.silu)
            fns["triton_per_expert"] = lambda: per_expert_calls(
                lambda xs, i, wt, e: fused_moe_w4a16(xs, i, wt, gu_e[e], dn_e[e], F.silu), x, idx, w, c.e)
            if kmajor is not None:
                fns["triton_kmajor"] = lambda: fused_moe_w4a16(x, idx, w, *kmajor, F.silu)
        if marlin is not None:
            from specter.kernels.marlin_moe import marlin_moe

            fns["marlin"] = lambda: marlin_moe(x, idx, w, marlin, F.silu)
        row: dict[str, float] = {}
        with torch.inference_mode():
            for name, fn in fns.items():
                if name not in methods:
                    continue
                check_dtype(name, fn(), dtype)  # doubles as the first warm-up call
                slow = name == "reference"  # fewer repetitions keep the grid affordable
                row[name] = median_ms(fn, min(warmup, 1) if slow else warmup, max(3, reps // 5) if slow else reps,
                                      device)
        out.append(row)
    return out


def check_dtype(name: str, out: torch.Tensor, dtype: torch.dtype) -> None:
    """A ratio compares two backends in one dtype: refuse a backend whose output is another one."""
    if out.dtype != dtype:
        raise SystemExit(f"{name} returned {out.dtype}, not the benchmark's {dtype}: its ratios would mix dtypes")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default="results/bench/draft_kernel.csv", help="output CSV path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="activation dtype (default: bfloat16 on CPU, float16 on CUDA as hardware=cuda)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="T of the tiny grid")
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 60, 64])
    ap.add_argument("--topk", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--dims", nargs="*", default=None, help="HxI pairs of the tiny grid (default 128x128 512x512 "
                    "on CPU, 128x128 on CUDA; none: real shapes only)")
    ap.add_argument("--real-tokens", type=int, nargs="*", default=None,
                    help="T at the real shapes (default: CPU 1 4, CUDA 1 4 16 64 256 1024; none: skip them)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default 3; --quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per point, median kept (default 15; --quick 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch's default; 1 avoids OpenMP waits on shared machines)")
    ap.add_argument("--skip", nargs="*", default=[], choices=METHODS, help="methods not to time")
    ap.add_argument("--only", nargs="*", default=None, choices=METHODS, help="time only these methods")
    ap.add_argument("--marlin", action="store_true",
                    help="also time Marlin (CUDA; gptqmodel may compile its extension first, minutes)")
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat the whole grid this many times, one after the other (rows carry `run`; the figures "
                         "take each point's median over runs): on a shared machine load drifts by the minute")
    ap.add_argument("--quick", action="store_true",
                    help="small grid: T in {1,8,64}, E=64, k in {2,6}, 5 timed calls per point; on a CPU no real shapes")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.reps is None:
        args.reps = 5 if args.quick else 15
    return args


def grid(args: argparse.Namespace, cuda: bool) -> list[Case]:
    """The tiny shapes (every HxI, E, k with k <= E) and then the real models' shapes, each with its T values."""
    tokens = args.tokens or ([1, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    dims = args.dims if args.dims is not None else (["128x128"] if cuda else ["128x128", "512x512"])
    real_tokens = args.real_tokens
    if real_tokens is None:
        real_tokens = [] if args.quick and not cuda else ([1, 4, 16, 64, 256, 1024] if cuda else [1, 4])
    experts, topk = ([64], [2, 6]) if args.quick else (args.experts, args.topk)
    if cuda and not args.tokens and not args.quick:
        experts, topk = [64], [6]  # on a GPU the tiny shapes are a sanity point, the real ones the data
    cases = [Case(*(int(v) for v in d.lower().split("x")), e, k, tuple(tokens), args.reps)
             for d in dims for e in experts for k in topk if k <= e]
    real_reps = args.reps if cuda else max(3, args.reps // 3)  # a real-shape call takes 0.01-2 s on a CPU
    cases += [Case(h, i, e, k, tuple(real_tokens), real_reps) for h, i, e, k in REAL_SHAPES if real_tokens]
    return cases


def timed_methods(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> set[str]:
    """The methods asked for that this machine can run; each one skipped is printed with its reason."""
    wanted = set(args.only) if args.only else set(METHODS) - set(args.skip) - ({"marlin"} if not args.marlin else set())
    why = available_methods(device, dtype, wanted)
    for m, reason in sorted(why.items()):
        if reason:
            print(f"skip {m}: {reason}")
    return {m for m in wanted if not why[m]}


def time_grid(cases: list[Case], methods: set[str], device: torch.device, dtype: torch.dtype, warmup: int,
              runs: int) -> list[dict[str, object]]:
    """One CSV row per (run, shape, T), each printed as it is timed under a header of the methods and ratios."""
    cuda = device.type == "cuda"
    shown = [m for m in METHODS if m in methods]
    print(f"device={device} ({device_name(device)}) dtype={dtype} threads={torch.get_num_threads()} "
          "(median ms; ratios a/b > 1: b faster)")
    print(f"{'H':>5} {'I':>5} {'E':>3} {'k':>2} {'T':>5} " + " ".join(f"{m[:9]:>9}" for m in shown) + " "
          + " ".join(f"{a[:5] + '/' + b[:6]:>13}" for a, b in RATIOS))
    rows = []
    for run in range(runs):
        gen = torch.Generator().manual_seed(0)  # every run times the same weights and inputs
        for c in cases:
            for t, ms in zip(c.tokens, bench_shape(c, dtype, device, methods, warmup, c.reps, gen)):
                row: dict[str, object] = {"device": device.type, "device_name": device_name(device),
                                          "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                                          "H": c.h, "I": c.i, "E": c.e, "k": c.k, "T": t, "run": run}
                row.update({f"{m}_ms": ms.get(m, math.nan) for m in METHODS})
                ratios = [ms.get(a, math.nan) / ms.get(b, math.nan) for a, b in RATIOS]
                row.update({f"{a}_over_{b}": r for (a, b), r in zip(RATIOS, ratios)})
                rows.append(row)
                print(f"{c.h:>5} {c.i:>5} {c.e:>3} {c.k:>2} {t:>5} " + " ".join(f"{ms.get(m, math.nan):>9.3f}" for m in shown)
                      + " " + " ".join(f"{r:>13.2f}" for r in ratios), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("float16" if cuda else "bfloat16")]
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = timed_methods(args, device, dtype)
    cases = grid(args, cuda)
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    rows = time_grid(cases, methods, device, dtype, args.warmup, args.runs)
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
