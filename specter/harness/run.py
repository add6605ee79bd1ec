"""The measurement protocol: prompts × repeats → records.csv, summary.csv, config.yaml, env.json.

Order of work: validate the config, load prompts (both fail fast, before any model loads), open
or resume the output folder, load the method's model, warm up outside timing, then one timed
generation per missing record, each from a cache reset and a per-record seed.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specter.harness.config import resident_experts, validate
from specter.harness.datasets import expand_datasets, load_prompts
from specter.harness.methods import build_method
from specter.harness.output import open_output_dir, write_environment
from specter.harness.records import RecordWriter, token_digest
from specter.harness.summary import print_summary, write_summary
from specter.speculative.sampling import make_generator
from specter.harness.runtime import model_checkpoint


def record_seed(base: int, dataset: str, prompt_index: int, repeat: int) -> int:
    """A stable seed per record, independent of run order (so resumed runs match)."""
    return (base + zlib.crc32(f"{dataset}/{prompt_index}/{repeat}".encode())) % 2**31


def run(cfg: DictConfig) -> Path:
    validate(cfg)
    resident_experts(cfg)
    datasets = expand_datasets(cfg.dataset.name)
    prompts = {
        ds: load_prompts(ds, cfg.num_prompts, cfg.assets_dir, allow_hub=cfg.allow_hub)  # first N, fixed
        for ds in datasets
    }
    out = open_output_dir(cfg)
    writer = RecordWriter(out / "records.csv")
    base = {"method": cfg.method.name, "model": cfg.model.name, "memory": cfg.memory.name}
    todo = [
        (ds, i, r)
        for ds in datasets
        for i in range(len(prompts[ds]))
        for r in range(cfg.repeats)
        if not writer.is_done(tuple(str(v) for v in (*base.values(), ds, i, r)))
    ]
    if todo:
        _measure(cfg, out, writer, base, prompts, todo)
    else:
        print(f"{out}: every record is already finished; nothing to run (records are never overwritten).")
    summary = write_summary(out)
    print_summary(summary, title=f"{out}/summary.csv")
    return out


def _measure(cfg, out, writer, base, prompts, todo) -> None:
    from transformers import AutoTokenizer

    if cfg.hardware.get("threads"):
        torch.set_num_threads(int(cfg.hardware.threads))
    checkpoint = model_checkpoint(cfg)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    method = build_method(cfg, checkpoint)
    write_environment(out, {"method": method.environment(), "checkpoint": str(checkpoint)})
    device = method.device

    def encode(text: str) -> torch.Tensor:
        ids = tokenizer(text, add_special_tokens=False).input_ids[: cfg.prefix_tokens]
        if not ids:
            raise ValueError("a prompt tokenized to zero tokens")
        return torch.tensor([ids], device=device)  # [1, P]

    try:
        if cfg.warmup_tokens > 0:  # outside timing: kernels, allocator, caches
            first_ds = todo[0][0]
            method.generate(encode(prompts[first_ds][0]), cfg.warmup_tokens, make_generator(device, 0))
            method.warmed()
        static = {"hardware": cfg.hardware.name, "prefix_tokens": cfg.prefix_tokens, **method.static_fields()}
        for ds, i, r in tqdm(todo, desc=f"{cfg.method.name}/{cfg.model.name}", disable=not cfg.progress, unit="rec"):
            prompt_ids = encode(prompts[ds][i])
            seed = record_seed(cfg.seed, ds, i, r)
            method.reset()  # outside timing
            gen = method.generate(prompt_ids, cfg.max_new_tokens, make_generator(device, seed))
            row = {
                **base, "dataset": ds, "prompt_index": i, "repeat": r, **static,
                "prefix_tokens": prompt_ids.shape[1], "new_tokens": len(gen.tokens),
                **gen.clock.latency(), **gen.stats,
                "output_digest": token_digest(gen.tokens), "seed": seed,
            }
            writer.append(row)
    finally:
        method.close()
