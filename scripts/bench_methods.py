"""Side-by-side benchmark of decoding methods on the (briefly trained) tiny models.

Runs the normal harness for every (model, memory tier, method variant) in one process, one after
another, into resumable run folders under --out, then writes one CSV of per-run medians and the
ratios that matter, and prints it:

    python scripts/bench_methods.py                       # all suites, emulated link
    python scripts/bench_methods.py --suite prefetch --models tiny_dsv2 --memory low
    python scripts/bench_methods.py --num-prompts 1 --max-new-tokens 32   # a quick look

Suites:  offload   target_only vs offload_ar
         specter   offload_ar vs specter (adaptive prefetch)
         prefetch  specter with prefetch adaptive / none / late / oracle vs offload_ar
         decode    target_only, offload_ar and specter on both decode paths (transformers' modules,
                   and the compact decoder: method.decode_path=compact), and target_only with the
                   compact decoder's compiled one-token step (method.decode_path=compiled)
Ratios are speedups over offload_ar (TPOT_offload_ar / TPOT_method, >1 = faster), measured in the
same process on the same machine; medians over records. Needs the trained tiny models
(python initialization/train_tiny.py) unless --untrained.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from specter.assembly.compose import compose
from specter.records.records import read_records

REPO = Path(__file__).resolve().parents[1]

SUITES = {
    "offload": [("target_only", {}), ("offload_ar", {})],
    "specter": [("offload_ar", {}), ("specter", {"method.prefetch": "adaptive"})],
    "prefetch": [("offload_ar", {})] + [("specter", {"method.prefetch": p}) for p in ("adaptive", "none", "late", "oracle")],
    "decode": [(m, {**x, **p}) for m, x in (("target_only", {}), ("offload_ar", {}),
                                             ("specter", {"method.prefetch": "adaptive"}))
               for p in ({}, {"method.decode_path": "compact"})]
              + [("target_only", {"method.decode_path": "compiled"})],
}


def variant_name(method: str, extra: dict) -> str:
    """offload_ar, specter[adaptive], specter[adaptive,compact], target_only[compiled], ..."""
    tags = [extra.get("method.prefetch", "adaptive")] if method == "specter" else []
    if extra.get("method.decode_path") in ("compact", "compiled"):
        tags.append(extra["method.decode_path"])
    return f"{method}[{','.join(tags)}]" if tags else method


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    ap.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen", "tiny_phi"])
    ap.add_argument("--memory", nargs="+", default=["high", "low"])
    ap.add_argument("--hardware", default="emulated")
    ap.add_argument("--datasets", default="humaneval,gsm8k", help="comma list (prepared assets or bundled)")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--K", type=int, default=None, help="speculation depth (default: the model config's K)")
    ap.add_argument("--assets", default=None, help="assets_dir for datasets")
    ap.add_argument("--untrained", action="store_true", help="use the random-weight tiny models")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = ap.parse_args(argv)

    from specter.assembly.errors import USER_ERRORS, report
    from specter.experiments.run import run

    variants = []
    for suite in SUITES if args.suite == "all" else [args.suite]:
        for v in SUITES[suite]:
            if v not in variants:
                variants.append(v)
    out_root = Path(args.out)
    rows = []
    for model in args.models:
        for memory in args.memory:
            for dataset in args.datasets.split(","):
                for method, extra in variants:
                    name = variant_name(method, extra)
                    folder = f"{model}-{memory}-{dataset}-{name.replace('[', '-').rstrip(']').replace(',', '-')}"
                    overrides = [
                        f"model={model}", f"memory={memory}", f"method={method}", f"dataset={dataset}",
                        f"hardware={args.hardware}", f"num_prompts={args.num_prompts}", f"repeats={args.repeats}",
                        f"max_new_tokens={args.max_new_tokens}", f"model.trained={not args.untrained}",
                        f"output_dir={out_root / 'runs' / folder}",
                        *[f"{k}={v}" for k, v in extra.items()],
                    ]
                    if method == "target_only":
                        overrides.append("hardware.link=cpu")  # no transfers: nothing to emulate
                    if args.K is not None:
                        overrides.append(f"K={args.K}")
                    if args.assets:
                        overrides.append(f"assets_dir={args.assets}")
                    try:
                        out = run(compose(overrides))
                    except USER_ERRORS as err:
                        report(err)
                        return 2
                    rec = read_records(out / "records.csv")
                    rec["variant"] = name
                    rows.append(rec)
    records = pd.concat(rows, ignore_index=True)
    table = summarize(records)
    out_root.mkdir(parents=True, exist_ok=True)
    records.to_csv(out_root / "records_all.csv", index=False)
    table.to_csv(out_root / "bench_methods.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"\nwrote {out_root / 'bench_methods.csv'}")
    return 0


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    records = records.assign(h2d_mb_per_token=records.h2d_bytes / records.new_tokens / 1e6)
    g = records.groupby(["model", "memory", "variant"], sort=False)
    table = g.agg(
        records=("output_digest", "size"),
        tpot_ms=("tpot_ms", "median"),
        
        acceptance=("accepted_fraction", "mean"),
        mean_accepted_len=("mean_accepted_len", "mean"),
        h2d_mb_per_token=("h2d_mb_per_token", "mean"),
        prefetch_recall=("prefetch_recall", "mean"),
        prefetch_precision=("prefetch_precision", "mean"),
        overlap=("overlap_fraction", "mean"),
    ).reset_index()
    bytes_ = g.h2d_bytes.sum().values
    oracle = g.oracle_h2d_bytes.sum(min_count=1).values
    table["h2d_over_oracle"] = [b / o if o and o == o and o > 0 else float("nan") for b, o in zip(bytes_, oracle)]
    base = table[table.variant == "offload_ar"].set_index(["model", "memory"])
    for col, name in (("tpot_ms", "speedup_vs_offload_ar"),):
        table[name] = [
            base.loc[(m, mem), col] / t if (m, mem) in base.index else float("nan")
            for m, mem, t in zip(table.model, table.memory, table[col])
        ]
    # greedy outputs must agree across methods (same prompts, temperature 0)
    digests = records.groupby(["model", "memory", "dataset", "prompt_index", "repeat"]).output_digest.nunique()
    table.attrs["greedy_mismatches"] = int((digests > 1).sum())
    if table.attrs["greedy_mismatches"]:
        print(f"WARNING: {table.attrs['greedy_mismatches']} prompts whose greedy outputs differ across methods")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
