"""The real-width rehearsal: the three real architectures at their real widths, a few layers deep.

For each real model a random-weight checkpoint is built in a temporary folder from the shipped
config.json (`specter/models/real_configs/`) with only `--layers` decoder layers: real hidden,
expert and attention widths, real expert counts and vocabulary. It then goes through the real
command path (`experiment=compare`) at both tiers' slot counts per MoE layer:

    once per model   target_only, transformers, llamacpp (tier-independent: the references)
    per tier         offload_ar, specter (GPTQ draft, group 128; --quant rtn where gptqmodel is
                     absent, e.g. the GPU image), mo_sm (slots derived from Specter's bytes), specmoeoff

and checks, per model:
  * greedy output: every lossless method produced target_only's tokens (llama.cpp's PhiMoE routes
    differently and is compared for speed only);
  * budgets at real byte counts: each tier's budget is set to what Specter needs at B=1 (from the
    memory plan of this checkpoint) plus its staging cap; every offloading method's footprint in its
    env.json equals the memory plan's bytes for it exactly, and a budget 1 MB under Specter's
    footprint is refused (BudgetError) before any decoding.

    bash scripts/rehearse_real.sh                                   # all three, CPU
    python -m scripts.rehearse_real --models dsv2 --layers 2 --device cpu

Writes one row per (model, tier, method) to `--csv` (default <workdir>/rehearsal.csv). The
checkpoints (a few GB each in fp32) live under `--workdir` (default: the temp dir) and are removed
at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODELS = ("dsv2", "qwen15moe", "phi35moe")
# Phi-3.5-MoE at real width is ~1.26 GB per layer per byte of dtype (16 experts of 4096 x 6400):
# bfloat16 on the CPU keeps two layers near 5 GB; the others fit in float32.
CPU_DTYPES = {"dsv2": "float32", "qwen15moe": "float32", "phi35moe": "bfloat16"}
ONCE = ("target_only", "transformers", "llamacpp")
PER_TIER = ("offload_ar", "specter", "mo_sm", "specmoeoff")
OFFLOADING = ("offload_ar", "specter", "mo_sm", "specmoeoff")
NOT_COMPARABLE = {("phi35moe", "llamacpp")}  # llama.cpp's PhiMoE routes with softmax top-2, not sparsemixer
FIELDS = ("model", "tier", "method", "dtype", "device", "layers", "resident", "records", "tokens_equal",
          "footprint_engine", "footprint_plan", "footprint_equal", "budget", "tpot_ms", "seconds", "note")


def build_checkpoint(name: str, layers: int, dtype: str, out: Path, device: str = "cpu") -> Path:
    """A random-weight checkpoint of `name`'s real config with `layers` decoder layers (+ the tiny tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specter.models.footprint import load_config, real_config_path
    from specter.models.tiny import train_tokenizer

    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # the tokenizer's special ids (the tiny byte-level BPE: 1,024 ids, all inside the real vocabulary)
    config = load_config(real_config_path(name), num_hidden_layers=layers, bos_token_id=0, eos_token_id=0,
                         pad_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU where there is one: seconds instead of minutes
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    train_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def overrides(name: str, checkpoint: Path, tier: str, budget_gb: float | None, device: str, dtype: str,
              quant: str, max_new_tokens: int) -> list[str]:
    hw = "cuda" if device == "cuda" else "cpu"
    # its own model name: the artifact's MO-SM presets (slot counts of the full models) do not apply to a
    # 2-layer copy, so MO-SM derives its slots from Specter's bytes in both the engine and the plan
    o = [f"model={name}", f"model.name={name}_{checkpoint.name.split('-')[1]}", f"model.local_dir={checkpoint}",
         f"memory={tier}", f"hardware={hw}",
         f"hardware.dtype={dtype}", "dataset=humaneval", "num_prompts=1", "repeats=1",
         f"max_new_tokens={max_new_tokens}", "warmup_tokens=0", "progress=false", "allow_hub=false",
         "method=specter", f"method.quant={quant}"]
    if budget_gb is not None:
        o.append(f"model.tiers.{tier}.budget_gb={budget_gb!r}")
    return o


def plan_for(cfg):
    from specter.assembly.plan import plan_rows

    rows, facts = plan_rows(cfg)
    return {(r.method, r.batch): r for r in rows}, facts


@dataclass(frozen=True)
class Rehearsal:
    """One model's rehearsal: what each of its compositions and csv rows repeats."""

    name: str
    layers: int
    device: str
    dtype: str
    quant: str
    workdir: Path
    max_new_tokens: int
    checkpoint: Path

    def overrides(self, tier: str, budget_gb: float | None = None) -> list[str]:
        return overrides(self.name, self.checkpoint, tier, budget_gb, self.device, self.dtype, self.quant,
                         self.max_new_tokens)

    def row(self, tier: str, method: str, **fields) -> dict:
        return {"model": self.name, "tier": tier, "method": method, "dtype": self.dtype, "device": self.device,
                "layers": self.layers, **fields}


def rehearse_model(name: str, layers: int, device: str, dtype: str, quant: str, workdir: Path,
                   max_new_tokens: int) -> list[dict]:
    """Every method on one real architecture at both tiers; returns the csv rows (raises on a failed check)."""
    t0 = time.perf_counter()
    checkpoint = build_checkpoint(name, layers, dtype, workdir / "models" / f"{name}-{layers}l-{dtype}", device)
    print(f"rehearse {name}: checkpoint {checkpoint} ({sum(f.stat().st_size for f in checkpoint.glob('*.safetensors')) / 1e9:.2f} GB, "
          f"built in {time.perf_counter() - t0:.0f} s)", flush=True)
    r = Rehearsal(name, layers, device, dtype, quant, workdir, max_new_tokens, checkpoint)
    rows: list[dict] = []
    reference: dict[str, str] = {}  # target_only's output digest per prompt (filled by the first tier)
    failures: list[str] = []
    for i, tier in enumerate(("high", "low")):
        rows += rehearse_tier(r, tier, i == 0, reference, failures)
    if failures:
        raise AssertionError("; ".join(failures))
    print(f"rehearse {name}: all checks passed in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def tier_budget(r: Rehearsal, tier: str) -> tuple[int, int]:
    """(the tier's budget, Specter's B = 1 bytes without staging) from this checkpoint's memory plan: the
    budget is what Specter needs at B = 1 with its staging cap, + 1 MB."""
    from specter.assembly.compose import compose

    plan, facts = plan_for(compose([*r.overrides(tier), "experiment=plan", f"output_dir={r.workdir / 'plan'}"]))
    spec = plan[("specter", 1)]
    base_total = spec.total - spec.staging * facts["expert_bytes"]
    cap = round(1.2 * facts["moe_layers"])
    return base_total + cap * facts["expert_bytes"] + (1 << 20), base_total


def rehearse_tier(r: Rehearsal, tier: str, first: bool, reference: dict[str, str], failures: list[str]) -> list[dict]:
    """One tier: the comparison of every method that fits (the references too on the `first` tier), the
    plan's refusals checked against the engine, and a budget 1 MB under Specter's footprint refused."""
    from omegaconf import open_dict

    from specter.experiments.compare import compare
    from specter.assembly.compose import compose

    budget, base_total = tier_budget(r, tier)
    args = [*r.overrides(tier, budget / 1e9), "experiment=compare", f"output_dir={r.workdir / 'runs' / f'{r.name}-{tier}'}"]
    cfg = compose(args)
    methods = [m for m in ((ONCE if first else ()) + PER_TIER) if m != "llamacpp"]
    plan, facts = plan_for(compose([*args[:-2], "experiment=plan", f"output_dir={r.workdir / 'plan'}"]))
    # what the plan says does not fit this budget (e.g. SpecMoEOff's second copy of the non-expert
    # tensors) must be refused by the engine, not run
    refused = [m for m in methods if m in OFFLOADING and not plan[(m, 1)].fits_budget]
    methods = [m for m in methods if m not in refused]
    with open_dict(cfg):
        cfg.compare.methods = methods
        cfg.compare.method_overrides = {
            "specter": {"quant": r.quant}, "specmoeoff": {"quant": r.quant},
        }
    t = time.perf_counter()
    root = compare(cfg)
    rows = [refusal_row(r, cfg, tier, m, plan, budget, failures) for m in refused]
    rows = [row for row in rows if row is not None]
    seconds = time.perf_counter() - t
    if first and r.device == "cpu":  # llama.cpp: its own GGUF export; a failure is reported, the rest still runs
        rows += run_llamacpp(r, cfg, methods, failures)
    rows += [method_row(r, tier, m, root / m, plan, budget, seconds, reference, failures) for m in methods]
    rows += budget_under(r, tier, base_total, failures)
    return rows


def refusal_row(r: Rehearsal, cfg, tier: str, method: str, plan: dict, budget: int, failures: list[str]) -> dict | None:
    """A method the plan says does not fit: its build must raise BudgetError (a row), not succeed (a failure)."""
    from specter.experiments.compare import method_config
    from specter.assembly.config import bind_checkpoint
    from specter.assembly.errors import BudgetError
    from specter.assembly.methods import build_method

    try:
        refused_cfg = method_config(cfg, method)
        bind_checkpoint(refused_cfg, r.checkpoint)  # the checkpoint's facts, as every run gets them
        build_method(refused_cfg, r.checkpoint).close()
        failures.append(f"{r.name} {tier} {method}: the plan says it does not fit, yet the engine accepted it")
    except BudgetError:
        return r.row(tier, method, footprint_plan=plan[(method, 1)].total, budget=budget,
                     note="refused (BudgetError), as the plan predicted")
    return None


def run_llamacpp(r: Rehearsal, cfg, methods: list[str], failures: list[str]) -> list[dict]:
    """llama.cpp's run (its own GGUF export), appended to `methods` when it ran; a failure is a row."""
    try:
        from specter.experiments.compare import method_config
        from specter.experiments.run import run

        run(method_config(cfg, "llamacpp"))
        methods.append("llamacpp")
    except Exception as err:  # noqa: BLE001 - recorded as a failed check below
        failures.append(f"{r.name} llamacpp: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return [r.row("-", "llamacpp", note=f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")]
    return []


def method_row(r: Rehearsal, tier: str, method: str, folder: Path, plan: dict, budget: int, seconds: float,
               reference: dict[str, str], failures: list[str]) -> dict:
    """One method's run folder checked: its tokens against target_only's, an offloading method's
    footprint against the plan's bytes."""
    rec = list(csv.DictReader((folder / "records.csv").open()))
    env = json.loads((folder / "env.json").read_text())
    digest = ";".join(row["output_digest"] for row in rec)
    if method == "target_only":
        reference.update({row["prompt_index"]: row["output_digest"] for row in rec})
    comparable = (r.name, method) not in NOT_COMPARABLE
    equal = (all(reference.get(row["prompt_index"]) == row["output_digest"] for row in rec)
             if reference and comparable else None)
    if equal is False:
        failures.append(f"{r.name} {tier} {method}: tokens differ from target_only ({digest[:16]}...)")
    fp_engine = fp_plan = None
    same = None
    if method in OFFLOADING:
        fp = env["method"]["footprint_bytes"]
        fp_engine = fp["total"]
        p = plan[(method, 1)]
        fp_plan = p.total
        engine = (fp["non_expert"], fp["cache_slots"] + fp["staging"], fp["draft_experts"] + fp["draft_non_expert"],
                  fp["kv_cache"], fp["scratch"])
        same = engine == (p.non_expert, p.cache_slots, p.draft, p.kv_cache, p.scratch)
        if not same:
            failures.append(f"{r.name} {tier} {method}: engine footprint {fp} != plan "
                            f"{(p.non_expert, p.cache_slots, p.draft, p.kv_cache, p.scratch)}")
    tpots = [float(row["tpot_ms"]) for row in rec if row.get("tpot_ms")]
    return r.row(tier if method not in ONCE else "-", method,
                 resident=env["method"].get("resident_experts_per_layer", ""), records=len(rec),
                 tokens_equal="" if equal is None else equal, footprint_engine=fp_engine or "",
                 footprint_plan=fp_plan or "", footprint_equal="" if same is None else same,
                 budget=budget if method in OFFLOADING else "", tpot_ms=min(tpots) if tpots else "",
                 seconds=round(seconds, 1), note="" if comparable else "not comparable (routing differs)")


def budget_under(r: Rehearsal, tier: str, base_total: int, failures: list[str]) -> list[dict]:
    """The budget is enforced at these byte counts: 1 MB under Specter's own footprint is refused."""
    from specter.assembly.compose import compose
    from specter.assembly.errors import BudgetError
    from specter.assembly.methods import build_method

    under = compose([*r.overrides(tier, (base_total - (1 << 20)) / 1e9), f"method.quant={r.quant}",
                     f"output_dir={r.workdir / 'refused'}"])
    try:
        method = build_method(under, r.checkpoint)
    except BudgetError as err:
        print(f"rehearse {r.name} {tier}: refused as expected: {str(err)[:160]}...", flush=True)
        return [r.row(tier, "specter (budget - 1 MB)", note="refused (BudgetError), as expected")]
    method.close()
    failures.append(f"{r.name} {tier}: a budget 1 MB under Specter's footprint was accepted")
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default=os.environ.get("DEVICE", "cpu"), choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, help="default: float16 on cuda; on cpu " + str(CPU_DTYPES))
    ap.add_argument("--quant", default=os.environ.get("QUANT", "gptq"), choices=("gptq", "rtn"))
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--csv", type=Path, default=Path(os.environ["OUT_CSV"]) if os.environ.get("OUT_CSV") else None)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and run folders")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: this process runs one model
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specter-rehearse-"))
    out_csv = args.csv or workdir / "rehearsal.csv"
    if args.one:  # one model in this process; rows appended to the csv
        name = args.models[0]
        dtype = args.dtype or ("float16" if args.device == "cuda" else CPU_DTYPES[name])
        rows = rehearse_model(name, args.layers, args.device, dtype, args.quant, workdir, args.max_new_tokens)
        new = not out_csv.exists()
        with out_csv.open("a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerows(rows)
        return 0
    t0 = time.perf_counter()
    status = 0
    try:
        for name in args.models:  # one process per model: each frees its checkpoint's memory on exit
            cmd = [sys.executable, "-m", "scripts.rehearse_real", "--one", "--models", name, "--layers", str(args.layers),
                   "--device", args.device, "--quant", args.quant, "--max-new-tokens", str(args.max_new_tokens),
                   "--workdir", str(workdir), "--csv", str(out_csv), *(["--dtype", args.dtype] if args.dtype else [])]
            t = time.perf_counter()
            rc = subprocess.call(cmd)
            print(f"rehearse {name}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t:.0f} s",
                  flush=True)
            if not args.keep:
                shutil.rmtree(workdir / "models", ignore_errors=True)
            status = status or rc
    finally:
        if not args.keep:
            for sub in ("models", "runs", "plan", "refused"):
                shutil.rmtree(workdir / sub, ignore_errors=True)
    print(f"rehearsal: {'all passed' if status == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s; rows in {out_csv}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
