"""`experiment=plan`: every method's device footprint from the model's config alone, before any weights.

    python run.py model=dsv2 memory=low hardware=cuda experiment=plan
    python run.py model=phi35moe memory=high hardware=cuda experiment=plan hardware.gpu_memory_gb=80
    python -m specter.experiments.plan                      # all three real models x both tiers

For each method and batch size (`batch.sizes`, default 1..32) it prints the footprint the engine's
budget check would compute — non-expert weights, expert slots, staging buffers, INT4 draft, KV cache
and scratch for the protocol's context (`prefix_tokens + max_new_tokens` + the method's K+1) — against
the tier's budget and the GPU's memory (`hardware.gpu_memory_gb`, default an A100 40 GB), and which
batch sizes fit. The numbers come from the same functions the engine calls: the meta-device skeleton
of `load_offloaded`, `scratch_bytes`, `budget_bytes`, the staging rule, MO-SM's `same_memory_slots`,
`draft_layer_nbytes`, llama.cpp's `gpu_layers_for_budget` and vLLM's `cpu_offload_gib`; the KV bytes
are the config arithmetic that tests check against the engine's one-token measurement. The real
models' config.json files ship in `specter/models/real_configs/` (a local checkpoint's own
config.json is used when present). Nothing is allocated: it runs in seconds on any machine.

Not counted: the CUDA context and the allocator's reserve (a few hundred MB on a real GPU); the GPU
margin printed is what is left for them.
"""

from __future__ import annotations

import csv
import io
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specter.assembly.plan import PlanRow, plan_rows
from specter.assembly.sizing import GB


def _gb(x: int) -> str:
    return f"{x / GB:.3f}"


def format_plan(cfg: DictConfig, rows: list[PlanRow], facts: dict[str, Any]) -> str:
    """The plan as text: the model's facts, one table of every method x batch size, what fits."""
    out = io.StringIO()
    f = facts
    gpu_name = "an A100 40 GB" if cfg.hardware.get("gpu_memory_gb") is None else f"a {f['gpu_bytes'] / GB:g} GB GPU"
    print(f"memory plan: {cfg.model.name} ({f['model_type']}), memory={cfg.memory.name} (M={f['resident']} of "
          f"{f['num_experts']} experts per MoE layer, budget {_gb(f['budget_bytes'])} GB), {f['dtype']} on "
          f"{f['device']}, against {gpu_name} ({_gb(f['gpu_bytes'])} GB)", file=out)
    print(f"  {f['num_layers']} layers ({f['moe_layers']} MoE), hidden {f['hidden']}, expert {f['hidden']}x"
          f"{f['expert_inter']} = {f['expert_bytes']:,} B, vocab {f['vocab']}, KV {f['kv_bytes_per_token']:,} B/token, "
          f"non-expert {_gb(f['non_expert_bytes'])} GB, all weights {_gb(f['full_bytes'])} GB, INT4 draft "
          f"{_gb(f['draft_bytes'])} GB; context {cfg.prefix_tokens}+{cfg.max_new_tokens} tokens (+K+1), K={f['K']}",
          file=out)
    print("  GB = 1e9 bytes; margin = budget (or GPU) minus total; the CUDA context is not counted", file=out)
    head = ("method", "B", "M", "stage", "non-exp", "slots", "draft", "KV", "scratch", "total", "budget margin",
            "GPU margin", "fits")
    table = [head]
    for r in rows:
        table.append((r.method, str(r.batch), "-" if r.resident is None else str(r.resident), str(r.staging),
                      _gb(r.non_expert), _gb(r.cache_slots), _gb(r.draft), _gb(r.kv_cache), _gb(r.scratch),
                      _gb(r.total), "-" if r.budget is None else _gb(r.budget - r.total), _gb(r.gpu - r.total),
                      ("yes" if r.fits else "no (budget)" if not r.fits_budget else "no (GPU)")))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  " + "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))),
              file=out)
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths), file=out)
    print("  fitting batch sizes (tier budget and GPU):", file=out)
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        ok = [r.batch for r in mine if r.fits]
        note = mine[0].note
        print(f"    {method:<12} {('B=' + ','.join(map(str, ok))) if ok else 'none'}"
              f"{'  (' + note + ')' if note else ''}", file=out)
    spec = next(r for r in rows if r.method == "specter" and r.batch == min(r.batch for r in rows))
    verdict = "fits" if spec.fits else "does NOT fit"
    before = spec.budget - spec.total + spec.staging * f["expert_bytes"]
    print(f"  specter at B={spec.batch}: {_gb(spec.total)} GB {verdict} the tier's budget (margin "
          f"{_gb(spec.budget - spec.total)} GB; {_gb(before)} GB before its {spec.staging} staging buffers, which take "
          f"what the budget still holds) and the GPU (margin {_gb(spec.gpu - spec.total)} GB); the tier's budget "
          f"{'fits' if f['budget_bytes'] <= f['gpu_bytes'] else 'EXCEEDS'} the GPU (margin "
          f"{_gb(f['gpu_bytes'] - f['budget_bytes'])} GB)", file=out)
    return out.getvalue()


CSV_FIELDS = ("model", "memory", "method", "batch", "resident", "staging", "non_expert", "cache_slots", "draft",
              "kv_cache", "scratch", "total", "budget", "gpu", "fits_budget", "fits_gpu", "note")


def plan_csv(cfg: DictConfig, rows: list[PlanRow]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        d = asdict(r)
        w.writerow({"model": cfg.model.name, "memory": cfg.memory.name,
                    **{k: ("" if d[k] is None else d[k]) for k in CSV_FIELDS if k in d}})
    return buf.getvalue()


def run_plan(cfg: DictConfig) -> Path:
    """`experiment=plan`: print the plan and write `<output_dir>/plan.csv` (exact bytes)."""
    from specter.paths import atomic_write_text

    rows, facts = plan_rows(cfg)
    print(format_plan(cfg, rows, facts), end="", flush=True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "plan.csv", plan_csv(cfg, rows))
    print(f"  bytes per component: {out / 'plan.csv'}")
    return out


PAPER_JOBS = tuple((m, t) for m in ("dsv2", "qwen15moe", "phi35moe") for t in ("high", "low"))


def main(argv: list[str] | None = None) -> int:
    """All three real models x both tiers (extra arguments are overrides, e.g. hardware.gpu_memory_gb=80)."""
    from specter.assembly.compose import compose
    from specter.assembly.errors import USER_ERRORS, report

    extra = list(sys.argv[1:] if argv is None else argv)
    for model, tier in PAPER_JOBS:
        try:
            run_plan(compose([f"model={model}", f"memory={tier}", "hardware=cuda", "experiment=plan", *extra]))
        except USER_ERRORS as err:
            report(err)
            return 2
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
