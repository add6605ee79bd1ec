"""Expert loads per token, loads over the Belady bound and TPOT: Specter's residency lru vs window, beside
MO-SM and SpecMoEOff, interleaved record by record as `experiment=cell` measures a cell.

For each model x memory tier it composes the cell's configuration (`experiment=cell`, the emulated link at
the model's default load ratio), builds one run folder per variant under --out, and measures the records
in rounds with the order rotated every round (specter/experiments/cell.py's protocol; Specter appears twice,
once per `method.residency`, which a plain cell cannot list). Then it prints and writes one CSV row per
(model, tier, variant):

    loads_per_token          H2D expert loads per generated token (records' h2d_bytes / expert bytes)
    loads_over_belady        H2D bytes over the Belady bound at the variant's own slots (sums over records)
    belady_loads_per_token   the bound in loads per token
    loads_per_window_layer   loads per route-log window and MoE layer (the windows the bound is over)
    retention_hits / _reloads  experts resident at a window's start that it used / of those, loaded again
    tpot_ms                  median TPOT; speedup_vs_lru: median paired TPOT ratio specter[lru] / variant
                             by prompt (each prompt's median over its repeats) with its bootstrap 95% CI
                             over prompts (>1: the variant is faster; speedup_ci_straddles_1 where it holds 1)
    specter_speedup          TPOT(variant) / TPOT(specter[window]) paired the same way, with specter_low/_high
                             (>1: Specter as it ships is faster than the variant)

    python scripts/bench_load_efficiency.py --models tiny_dsv2 tiny_qwen --memory high \\
        --num-prompts 2 --max-new-tokens 48 --quant rtn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf, open_dict

REPO = Path(__file__).resolve().parents[1]
VARIANTS = (  # (name, method, method overrides)
    ("specter[lru]", "specter", {"residency": "lru"}),
    ("specter[window]", "specter", {"residency": "window"}),
    ("offload_ar", "offload_ar", {}),
    ("mo_sm", "mo_sm", {}),
    ("specmoeoff", "specmoeoff", {}),
)
SPECTER = "specter[window]"  # Specter as it ships: its speedup over every other variant is reported too


def variant_configs(cfg, variants, out: Path, quant: str | None):
    from specter.experiments.cell import method_config

    subs = []
    for name, method, extra in variants:
        sub = method_config(cfg, method)
        with open_dict(sub):
            for key, value in extra.items():
                OmegaConf.update(sub, f"method.{key}", value, force_add=True)
            if quant and "quant" in sub.method:
                sub.method.quant = quant
            sub.output_dir = str(out / name.replace("[", "-").replace("]", ""))
        subs.append(sub)
    return subs


def measure_cell(cfg, variants, out: Path, quant: str | None) -> list[tuple[str, Path]]:
    """The cell's records, interleaved (specter.experiments.cell's loop over our variants)."""
    from specter.experiments.cell import measure_interleaved
    from specter.experiments.run import prepare, record_keys

    subs = variant_configs(cfg, variants, out, quant)
    preps = [prepare(sub, sub.num_prompts) for sub in subs]
    folders = measure_interleaved(subs, preps, record_keys(subs[0], preps[0]), f"bench {cfg.model.name}")
    return [(name, folder) for (name, _, _), folder in zip(variants, folders)]


def table(model: str, tier: str, folders: list[tuple[str, Path]], expert_bytes: int) -> pd.DataFrame:
    from specter.records.paired import paired_by_prompt
    from specter.records.records import read_records

    recs = {name: read_records(f / "records.csv").sort_values(["dataset", "prompt_index", "repeat"]) for name, f in folders}
    base, specter = recs.get("specter[lru]"), recs.get(SPECTER)
    rows = []

    def paired(a: pd.DataFrame | None, b: pd.DataFrame):  # TPOT(a) / TPOT(b) by prompt: repeats time one prompt
        if a is None:
            return None
        return paired_by_prompt(pd.concat([a.assign(variant="a"), b.assign(variant="b")], ignore_index=True),
                                "variant", "a", "b")

    for name, df in recs.items():
        tokens = df.new_tokens.sum()
        oracle = df.oracle_h2d_bytes.sum(min_count=1)
        row = {
            "model": model, "memory": tier, "variant": name, "records": len(df),
            "resident_experts": df.resident_experts.iloc[0], "staging_buffers": df.staging_buffers.iloc[0],
            "load_ratio": df.load_ratio.iloc[0], "effective_load_ratio": df.effective_load_ratio.mean(),
            "acceptance_alpha": df.acceptance_alpha.mean(),
            "loads_per_token": df.h2d_bytes.sum() / expert_bytes / tokens,
            "loads_over_belady": df.h2d_bytes.sum() / oracle if oracle and oracle > 0 else None,
            "belady_loads_per_token": oracle / expert_bytes / tokens if oracle == oracle else None,
            "loads_per_window_layer": df.loads_per_window_layer.mean(),
            "retention_hits": df.retention_hits.mean(), "retention_reloads": df.retention_reloads.mean(),
            "hit_rate": df.hit_rate.mean(), "tpot_ms": df.tpot_ms.median(),
        }
        pr = paired(base, df)
        if pr is not None:
            row.update(speedup_vs_lru=pr.median, speedup_low=pr.low, speedup_high=pr.high, speedup_prompts=pr.prompts,
                       speedup_ci_straddles_1=pr.straddles_1)
        sp = paired(df, specter) if specter is not None and name != SPECTER else None
        if sp is not None:  # > 1: Specter is faster than this variant
            row.update(specter_speedup=sp.median, specter_low=sp.low, specter_high=sp.high,
                       specter_ci_straddles_1=sp.straddles_1)
        rows.append(row)
    return pd.DataFrame(rows)


def cell_config(model: str, tier: str, args: argparse.Namespace):
    """One cell's configuration: the trained proxy (as the reference cells run it: an untrained model's draft
    is noise), the emulated link at the model's default ratio, the real model's slots."""
    from specter.assembly.compose import compose

    return compose(["experiment=cell", f"model={model}", "model.trained=true", f"memory={tier}", "hardware=emulated",
                    f"dataset={args.dataset}", f"num_prompts={args.num_prompts}", "repeats=1",
                    f"max_new_tokens={args.max_new_tokens}", f"warmup_tokens={args.warmup_tokens}",
                    "progress=false", *args.overrides])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny_dsv2", "tiny_qwen"])
    ap.add_argument("--memory", nargs="+", default=["high"])
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--quant", choices=["gptq", "rtn"], default=None, help="draft quantisation (default: each method's)")
    ap.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS])
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "load_efficiency")
    ap.add_argument("--csv", type=Path, default=None, help="default: <out>/load_efficiency.csv")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every variant (e.g. model.load_ratio=4)")
    args = ap.parse_args(argv)

    variants = [v for v in VARIANTS if v[0] in args.variants]
    frames = []
    for model in args.models:
        for tier in args.memory:
            cfg = cell_config(model, tier, args)
            folders = measure_cell(cfg, variants, args.out / f"{model}-{tier}", args.quant)
            frames.append(table(model, tier, folders, _expert_bytes(cfg)))
            print(frames[-1].to_string(index=False, float_format=lambda v: f"{v:.3g}"), flush=True)
    result = pd.concat(frames, ignore_index=True)
    path = args.csv or args.out / "load_efficiency.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    result.to_csv(path, index=False)
    print(f"wrote {path}")
    return 0


def _expert_bytes(cfg) -> int:
    """Bytes of one routed expert of the configured model at the run's dtype (gate_up [2I,H] and down [H,I])."""
    import json

    import torch

    from specter.assembly.runtime import device_and_dtype, model_checkpoint

    _, dtype = device_and_dtype(cfg)
    conf = json.loads((model_checkpoint(cfg) / "config.json").read_text())
    inter = conf.get("moe_intermediate_size") or conf["intermediate_size"]
    return 3 * conf["hidden_size"] * inter * torch.tensor([], dtype=dtype).element_size()


if __name__ == "__main__":
    sys.exit(main())
