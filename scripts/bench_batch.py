"""Batched decoding benchmark: TPOT and throughput against the batch size B, per method, beside the paper.

Runs `experiment=batch` for every (model, memory tier, method) in one process, one after another,
into resumable run folders under --out, then writes one CSV of every size's batch row plus the
scaling ratios the paper quotes, and prints both:

    python -m scripts.bench_batch                                   # trained tiny_dsv2 + tiny_qwen, both tiers
    python -m scripts.bench_batch --models tiny_dsv2 --memory low --sizes 1 2 4 --max-new-tokens 32

Methods: specter, offload_ar and specmoeoff, each decoding the same prompts B at a time (greedy;
every method's tokens are checked to agree across sizes and methods). Ratios:
  tpot_x_B1 / throughput_x_B1   TPOT(B)/TPOT(1), throughput(B)/throughput(1) of the same method
  specter_tpot_speedup          TPOT_method / TPOT_specter at the same B (>1: Specter faster)
  specter_throughput_ratio      throughput_specter / throughput_method at the same B
TPOT is the per-request mean (the paper's "mean TPOT"); medians are in the CSV too. Needs the
trained tiny models unless --untrained.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from specter.assembly.compose import compose
from specter.records.records import read_records
from specter.experiments.batch import BATCH_SCHEMA
from specter.records.rowstore import read_frame

REPO = Path(__file__).resolve().parents[1]

# The paper's batched results (high memory, A100, B = 1..32), as quoted in its text.
PAPER = {
    "tiny_dsv2": {"tpot_x_B32": 1.65, "throughput_x_B32": 9.41, "tpot_x_B2": 1.62, "working_set_x_B2": 1.31},
    "tiny_qwen": {"tpot_x_B32": 7.37, "throughput_x_B32": 3.54, "tpot_x_B2": 3.05, "working_set_x_B2": 1.52},
}
PAPER_VS_SPECMOEOFF = "DeepSeek-V2-Lite: up to 6.02x lower mean TPOT (B=32) and 3.89x throughput (B=16)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen"])
    ap.add_argument("--memory", nargs="+", default=["high", "low"])
    ap.add_argument("--methods", nargs="+", default=["specter", "offload_ar", "specmoeoff"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--hardware", default="emulated")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default: the largest B)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quant", default="gptq", help="draft quantization of specter and specmoeoff (gptq | rtn)")
    ap.add_argument("--assets", default=None, help="assets_dir for datasets")
    ap.add_argument("--untrained", action="store_true", help="use the random-weight tiny models")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "batch"))
    ap.add_argument("extra", nargs="*", help="more overrides for every run (key=value)")
    args = ap.parse_args(argv)

    from specter.experiments.batch import run_batch
    from specter.assembly.errors import USER_ERRORS, report

    out_root = Path(args.out)
    rows = []
    outputs: dict[tuple, set[str]] = {}  # (model, memory, dataset, prompt, repeat) -> output digests seen
    for model in args.models:
        for memory in args.memory:
            for method in args.methods:
                folder = out_root / "runs" / f"{model}-{memory}-{method}"
                overrides = [
                    "experiment=batch", f"model={model}", f"memory={memory}", f"method={method}",
                    f"dataset={args.dataset}", f"hardware={args.hardware}", f"batch.sizes=[{','.join(map(str, args.sizes))}]",
                    f"num_prompts={args.num_prompts or max(args.sizes)}", f"max_new_tokens={args.max_new_tokens}",
                    f"model.trained={not args.untrained}", f"output_dir={folder}", "progress=false",
                    *([f"method.quant={args.quant}"] if method in ("specter", "specmoeoff") else []),
                    *([f"assets_dir={args.assets}"] if args.assets else []), *args.extra,
                ]
                try:
                    run_batch(compose(overrides))
                except USER_ERRORS as err:
                    report(err)
                    return 2
                for B in args.sizes:
                    path = folder / f"B={B}" / "batch.csv"
                    if path.exists():
                        rows.append(read_frame(path, BATCH_SCHEMA))
                        rec = read_records(folder / f"B={B}" / "records.csv")
                        for r in rec.itertuples():
                            outputs.setdefault((model, memory, r.dataset, r.prompt_index, r.repeat), set()).add(
                                r.output_digest)
    table = ratios(pd.concat(rows, ignore_index=True))
    mismatches = sum(len(v) > 1 for v in outputs.values())
    out_root.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_root / "bench_batch.csv", index=False)
    shown = ["model", "memory", "method", "batch_size", "tpot_mean_ms", "tpot_median_ms", "tpot_p90_ms",
             "throughput_tok_s", "tpot_x_B1", "throughput_x_B1", "distinct_experts_per_layer", "h2d_bytes_per_token",
             "acceptance", "specter_tpot_speedup", "specter_throughput_ratio"]
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table[[c for c in shown if c in table.columns]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print("\nPaper (A100, high memory, B=1 -> 32):")
    for model, p in PAPER.items():
        print(f"  {model}: TPOT x{p['tpot_x_B32']}, throughput x{p['throughput_x_B32']}, TPOT x{p['tpot_x_B2']} at "
              f"B=1->2, working set x{p['working_set_x_B2']} at B=1->2")
    print(f"  vs SpecMoEOff: {PAPER_VS_SPECMOEOFF}")
    print(f"\ngreedy outputs that differ across batch sizes or methods: {mismatches}")
    print(f"wrote {out_root / 'bench_batch.csv'}")
    return 0 if mismatches == 0 else 1


def ratios(table: pd.DataFrame) -> pd.DataFrame:
    """Scaling against B=1 per (model, memory, method), and Specter against each method at the same B
    (rows of several datasets or repeats are averaged first)."""
    numeric = [c for c in table.columns if c not in ("model", "memory", "method", "batch_size")
               and pd.api.types.is_numeric_dtype(table[c])]
    t = table.groupby(["model", "memory", "method", "batch_size"], as_index=False)[numeric].mean()
    for col, name in (("tpot_mean_ms", "tpot_x_B1"), ("throughput_tok_s", "throughput_x_B1")):
        base = t[t.batch_size == 1].set_index(["model", "memory", "method"])[col]
        t[name] = [v / base.get((m, mem, meth), float("nan")) for m, mem, meth, v in
                   zip(t.model, t.memory, t.method, t[col])]
    spec = t[t.method == "specter"].set_index(["model", "memory", "batch_size"])
    key = list(zip(t.model, t.memory, t.batch_size))
    t["specter_tpot_speedup"] = [v / spec.tpot_mean_ms.get(k, float("nan")) for k, v in zip(key, t.tpot_mean_ms)]
    t["specter_throughput_ratio"] = [spec.throughput_tok_s.get(k, float("nan")) / v for k, v in zip(key, t.throughput_tok_s)]
    return t


if __name__ == "__main__":
    raise SystemExit(main())
