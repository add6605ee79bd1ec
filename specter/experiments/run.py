"""The measurement protocol: prompts × repeats → records.csv, summary.csv, config.yaml, env.json.

Order of work: validate the config and the device, load the prompts and the checkpoint, tokenize
every prompt (all of these fail fast, before any model loads and before the output folder is
touched), open the output folder under its lock (resume checks: configuration, prompts,
weights), load the method's model, warm up outside timing, then one timed generation per missing
record, each from a cache reset and a per-record seed.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specter.records.artifacts import SideTables
from specter.assembly.config import ConfigError, resident_experts, validate
from specter.datasets import DatasetFormatError, PromptSet, expand_datasets, load_prompt_set
from specter.assembly.load_ratio import calibrate_after_warmup, run_load_ratios
from specter.assembly.methods import Method, build_method
from specter.records.output import check_weights, refuse_other_prompt, run_folder, write_environment
from specter.records.records import RecordWriter, text_digest, token_digest
from specter.assembly.runtime import device_and_dtype, model_checkpoint
from specter.records.summary import print_summary, write_summary
from specter.speculative.sampling import make_generator


def record_seed(base: int, dataset: str, prompt_index: int, repeat: int) -> int:
    """A stable seed per record, independent of run order (so resumed runs match)."""
    return (base + zlib.crc32(f"{dataset}/{prompt_index}/{repeat}".encode())) % 2**31


def prompt_set_digest(texts: list[str]) -> str:
    """sha256 over the ordered prompts' sha256s: what a resumed run must measure again."""
    return hashlib.sha256("\n".join(text_digest(t) for t in texts).encode()).hexdigest()


def provenance_of(prompt_sets: dict[str, PromptSet]) -> dict:
    return {"datasets": {ds: {"source": ps.source, "file_sha256": ps.file_sha256, "num_prompts": len(ps.texts),
                              "prompt_set_sha256": prompt_set_digest(ps.texts)}
                         for ds, ps in prompt_sets.items()}}


@dataclass(frozen=True)
class Prepared:
    """What every protocol (run, run_batch) checks and loads before any model: prompts, checkpoint, ids."""

    datasets: list[str]
    prompt_sets: dict[str, PromptSet]
    checkpoint: Path
    prompt_ids: dict[str, list[list[int]]]


def prepare(cfg: DictConfig, num_prompts: int) -> Prepared:
    """Validate the config and the device, load the first `num_prompts` prompts of every dataset,
    resolve the checkpoint and tokenize: every failure here comes before a model loads."""
    validate(cfg)
    resident_experts(cfg, stated_experts=False)  # a stated model.num_experts is checked against the checkpoint
    device_and_dtype(cfg)  # a missing GPU is reported before anything loads
    datasets = expand_datasets(cfg.dataset.name)
    prompt_sets = {ds: load_prompt_set(ds, num_prompts, cfg.assets_dir, allow_hub=cfg.allow_hub) for ds in datasets}
    checkpoint = model_checkpoint(cfg)
    return Prepared(datasets, prompt_sets, checkpoint, tokenize_prompts(cfg, checkpoint, prompt_sets))


def environment_of(method: Method, checkpoint: Path, digest: str, **extra: Any) -> dict[str, Any]:
    """env.json's method part: the spec the method was built from, its own parameters, the weights and
    the model's routing facts (`model_routing`)."""
    return {"spec": method.final_spec().record(), "method": method.environment(), "checkpoint": str(checkpoint),
            "weights_sha256": digest, "model_routing": model_routing(checkpoint), **extra}


def model_routing(checkpoint: Path) -> dict[str, Any] | None:
    """The routing facts a trained model's report states (its `"routing"` entry: dead experts and
    usage entropy per MoE layer, measured on `tokens` tokens of `text`), or None when the checkpoint
    has no report or the report has no such entry. Read defensively: a missing, unreadable or
    malformed report is None, a malformed field is null, and nothing here stops a run."""
    from specter.models.tiny_train import TRAINED_REPORT
    from specter.paths import read_json_object

    try:
        routing = read_json_object(Path(checkpoint) / TRAINED_REPORT).get("routing")
    except (OSError, TypeError, ValueError):
        return None
    if not isinstance(routing, dict):
        return None

    def numbers(key: str, kind: type) -> list | None:
        v = routing.get(key)
        ok = isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        return [kind(x) for x in v] if ok else None

    text, tokens = routing.get("text"), routing.get("tokens")
    return {"dead_experts": numbers("dead_experts", int), "usage_entropy": numbers("usage_entropy", float),
            "text": text if isinstance(text, str) else None,
            "tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None}


def run(cfg: DictConfig) -> Path:
    prep = prepare(cfg, cfg.num_prompts)  # first N, fixed
    with run_folder(cfg, provenance_of(prep.prompt_sets), prompts=prompt_texts(prep)) as out:
        session = MethodSession(cfg, prep, out)
        if session.todo:
            try:
                session.start()
                for key in list(session.todo):
                    session.measure(*key)
            finally:
                session.close()
        else:
            print(f"{out}: every record is already finished; nothing to run (records are never overwritten).")
        summary = write_summary(out)
    print_summary(summary, title=f"{out}/summary.csv")
    return out


def prompt_texts(prep: Prepared) -> dict[str, list[str]]:
    return {ds: ps.texts for ds, ps in prep.prompt_sets.items()}


def record_keys(cfg: DictConfig, prep: Prepared) -> list[tuple[str, int, int]]:
    """Every (dataset, prompt_index, repeat) the protocol measures, in the order they run."""
    return [(ds, i, r) for ds in prep.datasets for i in range(len(prep.prompt_sets[ds].texts))
            for r in range(cfg.repeats)]


class MethodSession:
    """One method measured into its own run folder, one record at a time.

    Opening (the constructor) checks the folder's finished records and side tables and lists the
    records still missing (`todo`); `start` builds the method, warms it up outside timing and
    calibrates the link; `measure` times one record (from a cache reset and its per-record seed) and
    appends it; `close` frees the method. `run` drives one session through its records; a cell
    (specter/experiments/cell.py) drives several, interleaved record by record.
    """

    def __init__(self, cfg: DictConfig, prep: Prepared, out: Path):
        self.cfg, self.prep, self.out = cfg, prep, out
        self.prompts = prompt_texts(prep)
        self.writer = RecordWriter(out / "records.csv")
        self.base = {"method": cfg.method.name, "model": cfg.model.name, "memory": cfg.memory.name}
        _check_finished_prompts(out, self.writer, self.base, self.prompts)
        self.side = SideTables(out)
        repair_side_tables(out, self.writer, self.base, self.side)
        self.todo = [k for k in record_keys(cfg, prep) if not self.is_done(k)]
        self.method: Method | None = None
        self.progress = None

    def is_done(self, key: tuple[str, int, int]) -> bool:
        return self.writer.is_done(tuple(str(v) for v in (*self.base.values(), *key)))

    def _encode(self, ds: str, i: int) -> torch.Tensor:
        return torch.tensor([self.prep.prompt_ids[ds][i]], device=self.method.device)  # [1, P]

    def start(self) -> None:
        """Build, warm up (outside timing: kernels, allocator, caches), calibrate the link, write env.json."""
        from specter.models.registry import checkpoint_digest

        cfg, checkpoint = self.cfg, self.prep.checkpoint
        if cfg.hardware.get("threads"):
            torch.set_num_threads(int(cfg.hardware.threads))
        digest = checkpoint_digest(checkpoint)
        check_weights(self.out, digest, self.writer.finished)
        self.method = method = build_method(cfg, checkpoint)
        if cfg.warmup_tokens > 0:
            first_ds = self.todo[0][0] if self.todo else self.prep.datasets[0]
            method.generate(self._encode(first_ds, 0), cfg.warmup_tokens, make_generator(method.device, 0))
            method.warmed()
        step_s = calibrate_after_warmup(cfg, checkpoint, method)  # the link as the records will run it
        write_environment(self.out, environment_of(method, checkpoint, digest, rejected_rows=len(self.writer.rejected),
                                                   method_config=OmegaConf.to_container(cfg.method, resolve=True)))
        self.ratios = run_load_ratios(cfg, checkpoint, method, step_s)  # each record's effective load ratio
        self.static = {"hardware": cfg.hardware.name, "prefix_tokens": cfg.prefix_tokens, **method.static_fields()}
        self.progress = tqdm(total=len(self.todo), desc=f"{cfg.method.name}/{cfg.model.name}",
                             disable=not cfg.progress, unit="rec")

    def measure(self, ds: str, i: int, r: int, slot: int | None = None) -> dict[str, Any]:
        """Time one record and append it (its side-table blocks first); `slot`: its place in a cell's round."""
        cfg, method = self.cfg, self.method
        ids = self._encode(ds, i)
        seed = record_seed(cfg.seed, ds, i, r)
        method.reset()  # outside timing
        started = time.time()
        gen = method.generate(ids, cfg.max_new_tokens, make_generator(method.device, seed))
        finished = time.time()
        row = {
            **self.base, "dataset": ds, "prompt_index": i, "repeat": r, **self.static,
            "prefix_tokens": ids.shape[1], "new_tokens": len(gen.tokens),
            **gen.clock.latency(), **gen.stats,
            "prompt_sha256": text_digest(self.prompts[ds][i]),
            "output_digest": token_digest(gen.tokens), "seed": seed,
            **self.ratios.columns(f"{cfg.method.name}/{cfg.model.name} {ds} prompt {i} repeat {r}"),
            "started_at": started, "finished_at": finished, "slot": slot,
        }
        self.side.append({"dataset": ds, "prompt_index": i, "repeat": r}, gen.artifacts)  # before its record
        self.writer.append(row)
        self.todo.remove((ds, i, r))
        self.progress.update(1)
        return row

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.method is not None:
            self.method.close()
            self.method = None


def tokenize_prompts(cfg: DictConfig, checkpoint: Path, prompt_sets: dict[str, PromptSet]) -> dict[str, list[list[int]]]:
    """Prompt token ids, truncated to the prefix; a prompt with no token is a dataset error, found early."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    out = {}
    for ds, ps in prompt_sets.items():
        out[ds] = [tokenizer(text, add_special_tokens=False).input_ids[: cfg.prefix_tokens] for text in ps.texts]
        empty = [i for i, ids in enumerate(out[ds]) if not ids]
        if empty:
            raise DatasetFormatError(f"{ps.source}: prompt(s) {empty} of {ds} tokenize to zero tokens")
    return out


def _check_finished_prompts(out: Path, writer: RecordWriter, base: dict, prompts: dict[str, list[str]]) -> None:
    """Finished records must have been measured on the prompts this run would give them."""
    for key, digest in writer.prompt_digests.items():
        if not digest or tuple(key[:3]) != tuple(base.values()):
            continue
        refuse_other_prompt(out, key[3], int(key[4]), digest, prompts)


def repair_side_tables(out: Path, writer: RecordWriter, base: dict, side: SideTables) -> None:
    """Side tables hold whole blocks of finished records only, before anything is measured again.

    A finished record whose routes/trace block lost a line (torn, invalid) is measured again, as a
    torn record is: its record and its block are set aside. Blocks of records that never finished
    (a run stopped between a block and its record) are set aside too, so the block a rerun appends
    never runs on from a stale one of the same key."""
    from specter.records.artifacts import SIDE_TABLES, side_exists

    record_key = lambda k: (*base.values(), *k)  # noqa: E731 - side key (dataset, prompt_index, repeat)
    for name in SIDE_TABLES:
        if not side_exists(out, name):
            continue
        store = side.store(name)
        lost = {k for k in store.damaged if record_key(k) in writer.done}
        if lost:
            writer.store.set_aside_keys({record_key(k) for k in lost}, f"its {name}.csv block lost a line")
            store.set_aside_keys(lost, "a block that lost a line (its record is measured again)")
        unfinished = {k for k in store.keys if record_key(k) not in writer.done}
        if unfinished:
            store.set_aside_keys(unfinished, "the block of a record that never finished (measured again)")
