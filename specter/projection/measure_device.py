"""`python -m specter.projection.measure_device --out FILE`: the cost model's device parameters,
measured on the CUDA GPU this runs on, written as a device file (the format of `devices/*.yaml`).

Measured (CUDA events around back-to-back ops, the median of a few repeats):
- h2d_bandwidth / h2d_latency (and d2h_*): pinned host <-> device copies on a side stream at
  several sizes up to one real expert (DeepSeek-V2-Lite's FP16 expert, from the cost model);
  time(bytes) = latency + bytes / bandwidth fitted by least squares;
- hbm_bandwidth: a large device-to-device copy (bytes read + bytes written over its time);
- hbm_efficiency: an FP16 GEMV at a decode shape (one token through an expert-sized matrix) as
  a fraction of that copy bandwidth;
- launch_overhead: many tiny kernels launched eagerly, per kernel.
peak_fp16 and peak_int4_effective are not measured: they are copied from the base device file
(`--base`, default by GPU name) with their source saying so.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from specter.projection.cost_model import FP16, load_device, real_shape

PARAMS = ("hbm_bandwidth", "hbm_efficiency", "peak_fp16", "peak_int4_effective", "launch_overhead", "h2d_bandwidth",
          "h2d_latency", "d2h_bandwidth", "d2h_latency")
MEASURED = ("hbm_bandwidth", "hbm_efficiency", "launch_overhead", "h2d_bandwidth", "h2d_latency", "d2h_bandwidth",
            "d2h_latency")
SOURCE = "measured on {gpu} by scripts/gpu_check.sh"


def expert_bytes(model: str = "dsv2") -> int:
    s = real_shape(model)
    return 3 * s.hidden * s.expert_inter * FP16


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares time = latency + bytes / bandwidth; returns (bandwidth, latency >= 0)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sum((x - mx) ** 2 for x in sizes)
    return 1.0 / slope, max(0.0, my - slope * mx)


def device_yaml(name: str, values: dict[str, tuple[float, str]], comment: str = "") -> str:
    """A device file: every parameter of PARAMS as {value, source} (exact, fixed formatting)."""
    missing = [p for p in PARAMS if p not in values]
    if missing:
        raise ValueError(f"device file {name}: missing {missing}")
    lines = [f"# {comment}"] if comment else []
    lines.append(f"name: {name}")
    for p in PARAMS:
        value, source = values[p]
        lines.append(f"{p}: {{value: {float(value):.6e}, source: {json.dumps(source)}}}")
    return "\n".join(lines) + "\n"


def base_device_for(gpu: str) -> str:
    return "h200_pcie5" if "H200" in gpu.upper() or "H100" in gpu.upper() else "a100_40gb_pcie4"


def _median_ms(torch, fn, n: int, repeats: int = 5, stream=None) -> float:
    """Median over `repeats` of (seconds for `n` back-to-back calls of fn) / n, timed with CUDA events."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(out)


def measure() -> tuple[str, dict[str, float]]:
    """(GPU name, measured parameters) on cuda:0."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (torch.cuda.is_available() is False): "
                           "the device parameters can only be measured on a GPU")
    dev = torch.device("cuda", 0)
    gpu = torch.cuda.get_device_name(dev)
    eb = expert_bytes("dsv2")
    sizes = [1 << 16, 1 << 20, 1 << 22, eb // 2, eb]
    host = torch.empty(eb, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty(eb, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    out: dict[str, float] = {}
    for direction in ("h2d", "d2h"):
        times = []
        for n in sizes:
            src, dst = (host[:n], devbuf[:n]) if direction == "h2d" else (devbuf[:n], host[:n])
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)  # warm-up
                times.append(_median_ms(torch, lambda: dst.copy_(src, non_blocking=True), 10, stream=side))
        bw, lat = fit_latency_bandwidth([float(s) for s in sizes], times)
        out[f"{direction}_bandwidth"], out[f"{direction}_latency"] = bw, lat
    big = 1 << 30  # 1 GiB each way
    a = torch.empty(big, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    out["hbm_bandwidth"] = 2 * big / _median_ms(torch, lambda: b.copy_(a), 5)
    del a, b
    s = real_shape("dsv2")
    # [N, H]: 64 experts' rows, 369 MB: past any L2 (50 MB on Hopper), so the GEMV reads HBM
    w = torch.randn(64 * s.expert_inter, s.hidden, dtype=torch.float16, device=dev)
    x = torch.randn(1, s.hidden, dtype=torch.float16, device=dev)  # [1, H]: one decode token
    torch.nn.functional.linear(x, w)
    gemv = w.numel() * FP16 / _median_ms(torch, lambda: torch.nn.functional.linear(x, w), 20)
    out["hbm_efficiency"] = min(1.0, gemv / out["hbm_bandwidth"])
    t = torch.zeros(1, device=dev)
    t.add_(1)
    torch.cuda.synchronize(dev)
    out["launch_overhead"] = _median_ms(torch, lambda: t.add_(1), 2000)
    return gpu, out


def measured_values(gpu: str, measured: dict[str, float], base: str) -> dict[str, tuple[float, str]]:
    """Every parameter: the measured ones with their source, the others from the base device file."""
    src = SOURCE.format(gpu=gpu)
    ref = load_device(base)
    values = {p: (measured[p], src) for p in MEASURED}
    for p in PARAMS:
        if p not in values:
            values[p] = (getattr(ref, p), f"not measured; from {ref.name}: {ref.sources[p]}")
    return values


def slug(gpu: str) -> str:
    return "measured_" + (re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") or "gpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specter.projection.measure_device",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the device file to write (YAML)")
    parser.add_argument("--base", default=None,
                        help="device file for the parameters not measured (default: h200_pcie5 on an H100/H200, "
                             "else a100_40gb_pcie4)")
    args = parser.parse_args(argv)
    try:
        gpu, measured = measure()
    except RuntimeError as err:
        print(f"measure_device: {err}", file=sys.stderr)
        return 2
    base = args.base or base_device_for(gpu)
    text = device_yaml(slug(gpu), measured_values(gpu, measured, base),
                       comment=f"{gpu}, measured by scripts/gpu_check.sh. Units: bytes/s, FLOP/s, seconds.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    ref = load_device(base)
    for p in MEASURED:
        print(f"  {p:<16} measured {measured[p]:.4g}   {ref.name} file {getattr(ref, p):.4g}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
