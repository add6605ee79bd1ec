"""experiment=batch: the paper's batched evaluation (Figs. 15/16, Table 3).

    python run.py experiment=batch model=tiny_dsv2 hardware=emulated memory=low
    python run.py experiment=batch method=offload_ar batch.sizes=[4] num_prompts=8

For every batch size B in `batch.sizes`, every dataset and repeat, the same prompts (the first
`num_prompts`, at least max(batch.sizes); 16-token prefixes, 128 new tokens) are decoded B at a time, each group of B from a
cache reset, with each request's own seed. Results, per B, go to a run folder of their own,
``<output_dir>/B=<B>/`` (locked, resumable, like a K-sweep point):

    records.csv  one row per request (the usual record schema, `batch_size` = B; expert I/O columns
                 are empty there, because the I/O belongs to the whole batch)
    batch.csv    one row per (dataset, repeat): tpot_median_ms, tpot_p90_ms, tpot_mean_ms (per-request
                 TPOT over all requests), throughput_tok_s (generated tokens / batch wall time, first
                 admission to last commit, summed over the groups), distinct_experts_per_layer (the
                 verification working set per MoE layer per iteration, Fig. 16), h2d_bytes_per_token,
                 acceptance (mean per-request α), token_match_fraction (lossy methods: mean share of
                 target-only's tokens reproduced), and the I/O counters behind them

and ``<output_dir>/batch_summary.csv`` lists every size, measured or refused. Memory budgets
account for B: KV cache and scratch grow with B (`Footprint`), and a size whose footprint exceeds
the tier's budget is refused with the largest B that would fit; the other sizes still run.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specter.records.batch_schema import BATCH_COLUMNS, BATCH_SCHEMA
from specter.assembly.config import ConfigError, validate
from specter.assembly.load_ratio import calibrate_after_warmup
from specter.assembly.methods import Method, build_method
from specter.records.output import check_weights, run_folder, write_environment
from specter.records.records import RecordWriter, record_key, text_digest, token_digest
from specter.records.rowstore import RowStore, RowStoreError, read_frame, read_table
from specter.assembly.sizing import footprint_at, refusal
from specter.experiments.run import environment_of, prepare, provenance_of, record_seed
from specter.offload.budget import MB
from specter.paths import atomic_write_text
from specter.speculative.batched import BatchRun
from specter.speculative.sampling import make_generator


def batch_sizes(cfg: DictConfig) -> list[int]:
    sizes = list(cfg.batch.sizes)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ConfigError(f"batch.sizes must be integers >= 1, got {sizes}")
    return sorted(set(sizes))


def prompt_pool(cfg: DictConfig, sizes: list[int]) -> int:
    """Prompts per dataset that every size decodes: num_prompts, raised to the largest B (a batch of B
    needs B distinct prompts), with a note when raised."""
    n = max(cfg.num_prompts, max(sizes))
    if n > cfg.num_prompts:
        print(f"specter: note: batch size {max(sizes)} needs {n} prompts per dataset; every size decodes "
              f"{n} (num_prompts={cfg.num_prompts} raised)", flush=True)
    return n


# ---------------------------------------------------------------------------------- batch.csv


class BatchTable:
    """batch.csv through the validated row store (specter/records/rowstore.py): one fsynced line per
    (dataset, repeat), cut back on a failed write; torn or invalid rows set aside and measured again."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.store = RowStore(self.path, BATCH_SCHEMA)
        self.done: set[tuple[str, str]] = self.store.keys

    def is_done(self, dataset: str, repeat: int) -> bool:
        return (dataset, str(repeat)) in self.done

    def append(self, row: dict[str, Any]) -> None:
        self.store.append(row, what="a batch row")


# ---------------------------------------------------------------------------------- metrics
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-quantile (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def batch_row(runs: list[BatchRun]) -> dict[str, Any]:
    """Batch-level metrics over the groups of one (B, dataset, repeat)."""
    reqs = [r for run in runs for r in run.requests]
    tpots = [t for r in reqs if (t := r.clock.latency()["tpot_ms"]) is not None]
    ttfts = [t for r in reqs if (t := r.clock.latency()["ttft_ms"]) is not None]
    tokens = sum(len(r.tokens) for r in reqs)
    wall = sum(run.wall_seconds() for run in runs)
    iters = [run.stats.get("iterations") or 0 for run in runs]
    ws = [(run.stats.get("distinct_experts_per_layer"), n) for run, n in zip(runs, iters)]
    ws = [(w, n) for w, n in ws if w is not None and n]
    alphas = [a for r in reqs if (a := r.stats.get("acceptance_alpha")) is not None]
    drafted = sum(r.stats.get("drafted_tokens") or 0 for r in reqs)
    accepted = sum(r.stats.get("accepted_tokens") or 0 for r in reqs)

    def total(key: str):
        vals = [run.stats.get(key) for run in runs]
        return sum(vals) if vals and all(v is not None for v in vals) else None

    h2d = total("h2d_bytes")
    recalls = [v for run in runs if (v := run.stats.get("prefetch_recall")) is not None]
    matches = [m for r in reqs if (m := r.stats.get("token_match_fraction")) is not None]  # lossy methods only
    return {
        "requests": len(reqs), "batches": len(runs), "new_tokens": tokens, "wall_s": wall,
        "tpot_median_ms": statistics.median(tpots) if tpots else None,
        "tpot_p90_ms": percentile(tpots, 0.9),
        "tpot_mean_ms": statistics.fmean(tpots) if tpots else None,
        "ttft_median_ms": statistics.median(ttfts) if ttfts else None,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "distinct_experts_per_layer": sum(w * n for w, n in ws) / sum(n for _, n in ws) if ws else None,
        "h2d_bytes": h2d,
        "h2d_bytes_per_token": h2d / tokens if h2d is not None and tokens else None,
        "acceptance": statistics.fmean(alphas) if alphas else None,
        "accepted_fraction": accepted / drafted if drafted else None,
        "iterations": sum(iters),
        "demand_hits": total("demand_hits"), "demand_misses": total("demand_misses"),
        "copy_wait_ms": total("copy_wait_ms"), "oracle_h2d_bytes": total("oracle_h2d_bytes"),
        "prefetch_recall": statistics.fmean(recalls) if recalls else None,
        "kv_compactions": total("kv_compactions"),
        "token_match_fraction": statistics.fmean(matches) if matches else None,
    }


# ---------------------------------------------------------------------------------- protocol
def size_config(cfg: DictConfig, B: int) -> DictConfig:
    """The run-folder configuration of one batch size."""
    return OmegaConf.merge(cfg, {"batch": {"sizes": [B]}, "output_dir": str(Path(cfg.output_dir) / f"B={B}")})


def run_batch(cfg: DictConfig) -> Path:
    validate(cfg)
    sizes = batch_sizes(cfg)
    prep = prepare(cfg, prompt_pool(cfg, sizes))  # the same checks and prompts as `run`, before any model loads
    datasets, prompt_sets, checkpoint, prompt_ids = prep.datasets, prep.prompt_sets, prep.checkpoint, prep.prompt_ids
    root = Path(cfg.output_dir)
    todo = {B: [(ds, r) for ds in datasets for r in range(cfg.repeats)
                if not unit_finished(root / f"B={B}" / "batch.csv", ds, r)] for B in sizes}
    status: dict[int, str] = {B: "measured" for B in sizes}
    if any(todo.values()):
        status = _measure(cfg, checkpoint, prompt_sets, prompt_ids, todo)
    else:
        print(f"{root}: every batch size is already measured; nothing to run.")
    base = {"method": cfg.method.name, "model": cfg.model.name, "memory": cfg.memory.name}
    return write_batch_summary(root, sizes, status, base)


def unit_finished(path: Path, dataset: str, repeat: int) -> bool:
    """Whether a size's batch.csv already holds a valid (dataset, repeat) row; read only (no lock needed)."""
    if not path.exists():
        return False
    try:
        rows = read_table(path, BATCH_SCHEMA, warn=lambda msg: None, exact=True).values()
    except RowStoreError:
        return False  # another schema: refused with its message when the size's folder opens
    return any(r["dataset"] == dataset and r["repeat"] == str(repeat) for r in rows)


def _measure(cfg, checkpoint, prompt_sets, prompt_ids, todo: dict[int, list[tuple[str, int]]]) -> dict[int, str]:
    from specter.models.registry import checkpoint_digest

    if cfg.hardware.get("threads"):
        torch.set_num_threads(int(cfg.hardware.threads))
    digest = checkpoint_digest(checkpoint)
    method = build_method(cfg, checkpoint)
    status: dict[int, str] = {}
    try:
        device = method.device
        fits = []
        for B in todo:
            why = refusal(method, B)
            status[B] = f"refused: {why}" if why else "measured"
            if why:
                print(f"specter: batch size refused: {why}", flush=True)
            else:
                fits.append(B)
        fits = [B for B in fits if todo[B]]
        if not fits:
            return status
        first_ds = todo[fits[0]][0][0]
        if cfg.warmup_tokens > 0:  # outside timing, at the largest batch that runs
            n = max(fits)
            method.generate_batch([torch.tensor(p, device=device) for p in prompt_ids[first_ds][:n]], cfg.warmup_tokens,
                                  [make_generator(device, 0) for _ in range(n)])
            method.warmed()
        calibrate_after_warmup(cfg, checkpoint, method)  # env.json below records the re-timed link
        static = {"hardware": cfg.hardware.name, **method.static_fields()}
        base = {"method": cfg.method.name, "model": cfg.model.name, "memory": cfg.memory.name}
        for B in fits:
            sub = size_config(cfg, B)
            with run_folder(sub, provenance_of(prompt_sets),
                            prompts={ds: ps.texts for ds, ps in prompt_sets.items()}) as out:
                records = RecordWriter(out / "records.csv")
                check_weights(out, digest, records.finished)
                fp = footprint_at(method, B)
                write_environment(out, environment_of(method, checkpoint, digest, batch_size=B,
                                                      batch_footprint_bytes=fp.__dict__ if fp else None))
                table = BatchTable(out / "batch.csv")
                for ds, r in todo[B]:
                    if table.is_done(ds, r):
                        continue
                    runs = _decode_unit(cfg, method, prompt_ids[ds], ds, r, B)
                    for run in runs:
                        for req in run.requests:
                            row = _request_row(base, static, prompt_sets[ds].texts, ds, r, B, req, cfg.seed)
                            if not records.is_done(record_key(row)):  # kept from an interrupted attempt
                                records.append(row)
                    table.append({**base, **{k: static.get(k) for k in ("hardware", "K", "resident_experts")},
                                  "batch_size": B, "dataset": ds, "repeat": r, **batch_row(runs),
                                  "footprint_mb": fp.total / MB if fp else None,
                                  "budget_mb": method.rt.budget_bytes / MB if fp else None})
    finally:
        method.close()
    return status


def _decode_unit(cfg, method: Method, ids: list[list[int]], ds: str, repeat: int, B: int) -> list[BatchRun]:
    """The num_prompts prompts of one dataset, B at a time, each group from a cache reset."""
    device = method.device
    runs = []
    for start in range(0, len(ids), B):
        idx = list(range(start, min(start + B, len(ids))))
        prompts = [torch.tensor(ids[i], device=device) for i in idx]
        gens = [make_generator(device, record_seed(cfg.seed, ds, i, repeat)) for i in idx]
        method.reset()  # outside timing
        run = method.generate_batch(prompts, cfg.max_new_tokens, gens)
        for i, req in zip(idx, run.requests):
            req.rid = i
        runs.append(run)
    return runs


def _request_row(base, static, texts, ds, repeat, B, req, seed_base) -> dict[str, Any]:
    tokens = req.tokens[: req.max_new_tokens]
    return {
        **base, "dataset": ds, "prompt_index": req.rid, "repeat": repeat, **static, "batch_size": B,
        "prefix_tokens": req.prompt_len, "new_tokens": len(tokens), **req.clock.latency(), **req.stats,
        "prompt_sha256": text_digest(texts[req.rid]), "output_digest": token_digest(tokens),
        "seed": record_seed(seed_base, ds, req.rid, repeat),
    }


def write_batch_summary(root: Path, sizes: list[int], status: dict[int, str], base: dict[str, str]) -> Path:
    """batch_summary.csv: every size's batch.csv rows (averaged over repeats), plus refused sizes."""
    import pandas as pd

    frames = []
    for B in sizes:
        path = root / f"B={B}" / "batch.csv"
        if path.exists() and path.stat().st_size:
            df = read_frame(path, BATCH_SCHEMA, exact=True)
            if not df.empty:
                frames.append(df.assign(status="measured"))
        elif status.get(B, "").startswith("refused"):
            frames.append(pd.DataFrame([{**base, "batch_size": B, "status": status[B]}]))
    root.mkdir(parents=True, exist_ok=True)
    if not frames:
        print(f"{root}: no batch size could run")
        return root
    table = pd.concat(frames, ignore_index=True)
    try:
        atomic_write_text(root / "batch_summary.csv", table.to_csv(index=False))
    except OSError as err:
        raise RowStoreError(f"cannot write {root / 'batch_summary.csv'} ({err.strerror or err})") from None
    shown = [c for c in ("method", "model", "memory", "dataset", "batch_size", "tpot_median_ms", "tpot_p90_ms",
                         "throughput_tok_s", "distinct_experts_per_layer", "h2d_bytes_per_token", "acceptance", "status")
             if c in table.columns]
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"\nwrote {root / 'batch_summary.csv'} (per size: {root}/B=<B>/batch.csv and records.csv)")
    return root
