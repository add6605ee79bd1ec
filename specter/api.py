"""The Python API: Specter inside a program, without Hydra on the command line or an HTTP server.

    import specter

    with specter.load(model="tiny_dsv2", memory="low", method="specter", K=4, hardware="emulated") as llm:
        for out in llm.generate(["def fib(n):", "import os"], max_new_tokens=32):
            print(out.text, out.stats)               # TPOT, acceptance α, H2D bytes and loads, hit rate
        for piece in llm.stream("class Stack:", max_new_tokens=32):
            print(piece, end="", flush=True)

`load` takes the config groups and keys of `python run.py` as keyword arguments (a dotted key as
``**{"method.quant": "rtn"}``) and builds one Method through `load_overrides`, as `specter generate`
and `specter serve` do (`build_served` below: the same schema and checks, warm-up and link
calibration). `generate` decodes its prompts together through the one request scheduler
(specter/scheduler.py, which `specter serve` steps on its engine thread) over the method's batched
request loop (specter, the methods built on its engine, target_only, offload_ar), at most the memory
tier's largest fitting batch at a time, and one by one for a method without one. Bad input raises the
project's one-line exceptions (ConfigError and the other user errors of specter/assembly/errors.py)
before anything decodes.
`specter generate` is this module's `stream` on the command line, and `specter serve` answers HTTP
requests over an Engine (specter/cli.py). The HTTP server sits on this module, never the other way:
specter/serve imports its loading (`build_served`, `compose_checked`, `MAX_BATCH`), its text pieces
(`TextStream`) and its sampling range from here and its scheduler from specter/scheduler.py, and
nothing here imports specter.serve (tests/test_api_layering.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specter.assembly.config import SEED_LIMIT, ConfigError

if TYPE_CHECKING:  # torch, OmegaConf and the decoders load when a function needs them, not on import
    from omegaconf import DictConfig

    from specter.speculative.sampling import SamplingParams

MAX_BATCH = 32  # the largest batch the batched decoders are tested at (tests/test_batched.py)


# The sampling range every entry point that serves (specter generate, specter.load, specter serve) shares.
# Below GREEDY_BELOW decoding is greedy (as vLLM's sampler rules): dividing fp32 logits by a smaller
# positive temperature overflows to inf and the softmax to NaN (1e-38 did), and the distribution it stands
# for is the argmax's to within fp32 already. A top_p at or below TOP_P_FLOOR keeps only the most probable
# token, as every top_p below that token's probability (>= 1 / vocabulary) does, so raising it to the floor
# changes no nucleus while keeping it above fp32's smallest number (a top_p that rounds to 0 dropped all).
GREEDY_BELOW = 1e-5
TOP_P_FLOOR = 1e-30
SAMPLING_RANGE = (f"temperature must be a finite number >= 0 (below {GREEDY_BELOW:g}: greedy) and "
                  "top_p a finite number in (0, 1]")


def sampling_params(temperature: float, top_p: float, top_k: int = 0) -> Any:
    """The SamplingParams a request decodes with; ValueError naming the range outside it. Greedy settings
    drop top_p and top_k (greedy decoding reads neither), so every greedy request shares one decoder."""
    from specter.speculative.sampling import SamplingParams

    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature} ({SAMPLING_RANGE})")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a finite number in (0, 1], got {top_p} ({SAMPLING_RANGE})")
    if temperature < GREEDY_BELOW:
        return SamplingParams()
    return SamplingParams(float(temperature), max(float(top_p), TOP_P_FLOOR), int(top_k))


class EngineClosed(ConfigError):
    """The engine was closed: load a new one."""


class DecodeError(RuntimeError):
    """A prompt's decoding failed (a window raised); the message names the prompt and the error."""


@dataclass(frozen=True)
class Stats:
    """One request's statistics. I/O counts are those of the window(s) it decoded in: shared with the
    requests of its batch (``batch``), None for a method that keeps every expert on the device."""

    tokens: int  # tokens returned
    wall_s: float  # from the first step of its batch to the end of the request's decoding
    tpot_ms: float | None  # time per output token after the first (the records' TPOT)
    tokens_per_window: float | None  # tokens committed per target forward (> 1 when speculation pays)
    acceptance_alpha: float | None  # per-token draft acceptance α; None for a non-speculative method
    h2d_bytes: int | None  # host -> device expert bytes moved
    expert_loads: int | None  # expert copies submitted (demand and prefetch)
    expert_hits: int | None  # demand lookups found on the device
    expert_misses: int | None  # demand lookups that waited for a copy
    batch: int = 1  # requests decoded together (largest)

    @property
    def hit_rate(self) -> float | None:
        lookups = (self.expert_hits or 0) + (self.expert_misses or 0)
        return None if self.expert_hits is None or not lookups else self.expert_hits / lookups

    def line(self, method: str, finish_reason: str) -> str:
        """The one-line summary `specter generate` prints on stderr."""
        def f(v, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        n = self.tokens
        per_token = self.h2d_bytes / n / 1024 if self.h2d_bytes is not None and n else None
        return " | ".join([f"{method}: {n} tokens ({finish_reason}) in {self.wall_s:.2f} s",
                           f"TPOT {f(self.tpot_ms, '.2f')} ms", f"{f(self.tokens_per_window, '.2f')} tokens/window",
                           f"acceptance α {f(self.acceptance_alpha, '.3f')}", f"H2D {f(per_token, '.1f')} KiB/token",
                           f"expert hit rate {f(self.hit_rate, '.3f')}"])


@dataclass
class Completion:
    """One prompt's output: its text, token ids, why it ended ("length" or "stop": EOS) and statistics."""

    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats


@dataclass
class Stream:
    """`Engine.stream`'s iterator of text pieces; ``result`` is the Completion once it is exhausted.
    A stream left early decodes no further; `close()` frees its request's rows at once."""

    pieces: Iterator[str]
    result: Completion | None = field(default=None)

    def __iter__(self) -> Iterator[str]:
        return self.pieces

    def __next__(self) -> str:
        return next(self.pieces)

    def close(self) -> None:
        self.pieces.close()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------- loading
def overrides_of(settings: dict[str, Any]) -> list[str]:
    """Hydra override strings of keyword settings: ``K=8`` -> "K=8", ``**{"method.quant": "rtn"}`` ->
    "method.quant=rtn"; True/False/None as true/false/null; a string with Hydra's special characters
    quoted."""
    out = []
    for key, value in settings.items():
        if not key or not all(part.isidentifier() for part in key.lstrip("+~").split(".")):
            raise ConfigError(f"{key!r} is not a configuration key")
        out.append(f"{key}={_value(key, value)}")
    return out


def _value(key: str, value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        return repr(value)
    if isinstance(value, str):
        if value and all(c.isalnum() or c in "_-./:+@" for c in value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(key, v) for v in value) + "]"
    raise ConfigError(f"{key}: a {type(value).__name__} is not a configuration value (use a string, number, "
                      "bool, None or a list of them)")


def load(model: str | None = None, memory: str | None = None, method: str | None = None, *,
         max_batch: int | None = None, warm: bool = True, **overrides: Any) -> Engine:
    """An Engine over one built method (see the module docstring).

    ``model``, ``memory``, ``method`` choose the config groups (conf/); every other keyword is a
    key of the run configuration (``K=8``, ``hardware="emulated"``, ``temperature=0.7``,
    ``prefix_tokens=512`` to reserve room for longer prompts in a method without a request loop).
    ``max_batch`` caps the requests decoded together (default: the tier's largest fitting batch,
    at most 32)."""
    groups = {k: v for k, v in (("model", model), ("memory", memory), ("method", method)) if v is not None}
    for k, v in groups.items():
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{k} must be the name of a config in conf/{k}/, got {v!r}")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    return load_overrides(overrides_of({**groups, **overrides}), max_batch=max_batch, warm=warm)


def load_overrides(overrides: list[str], *, max_batch: int | None = None, warm: bool = True) -> Engine:
    """An Engine from Hydra override strings as the command line gives them ("model=tiny_dsv2", "K=8"):
    the one builder behind `load`, `specter generate` and `specter serve`."""
    return Engine(build_served(overrides, max_batch=max_batch or MAX_BATCH, warm=warm))


# One Method for interactive use, built as `python run.py` builds it: the same config groups, the same typed
# schema and checks, the same warm-up outside any timing, the same link calibration.
@dataclass
class Served:
    """A loaded method with what serving it needs."""

    cfg: DictConfig
    checkpoint: Path
    method: Any  # specter.assembly.methods.Method
    tokenizer: Any  # a transformers tokenizer
    context_length: int
    max_batch: int  # requests decoded together: the tier's largest fitting batch, at most MAX_BATCH

    @property
    def name(self) -> str:
        """The model name clients send (`model` field): the config's model name."""
        return str(self.cfg.model.name)

    def close(self) -> None:
        self.method.close()


def compose_checked(overrides: list[str]) -> DictConfig:
    """The run configuration of `overrides`, refused with a one-line ConfigError as run.py refuses it."""
    from specter.assembly.compose import check_optional_groups, compose
    from specter.assembly.config import check_home, resident_experts, unknown_keys, validate
    from specter.assembly.errors import composition_error
    from specter.assembly.runtime import device_and_dtype

    try:
        cfg = compose(overrides) if overrides else _plain_config()
    except Exception as err:  # noqa: BLE001 - Hydra/OmegaConf raise many types for a bad override
        raise composition_error(err) from None
    check_optional_groups(overrides)
    unknown = unknown_keys(cfg)  # `+typo=1` would be accepted and never used
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}: not in the configuration schema "
                          "(specter/assembly/schema.py); check the spelling")
    check_home()  # SPECTER_HOME a file: one line, not a NotADirectoryError from deep in a build
    validate(cfg)
    resident_experts(cfg)
    device_and_dtype(cfg)
    return cfg


def _plain_config() -> DictConfig:
    """conf/config.yaml with no override: `compose([])` would give run.py's default job (the comparison)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specter.assembly.compose import CONF_DIR, resolve_hardware
    from specter.assembly.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return resolve_hardware(hydra_compose(config_name="config", overrides=[]))


def largest_fitting_batch(method: Any, cap: int = MAX_BATCH) -> int:
    """The memory plan's number: the largest B whose footprint fits the tier's budget (experiment=batch
    refuses larger ones with the same number), at most ``cap``; ``cap`` where no budget applies."""
    from specter.assembly.sizing import footprint_at, largest_batch

    rt = method.rt
    one = footprint_at(method, 1)
    if rt is None or one is None:
        return cap
    fits = largest_batch(one, footprint_at(method, 2), rt.budget_bytes)
    if fits < 1:
        raise ConfigError(f"method {method.name!r}: not even one request fits the budget of "
                          f"{rt.budget_bytes / 2**20:.2f} MB")
    return int(min(cap, fits))


def build_served(overrides: list[str], *, max_batch: int = MAX_BATCH, warm: bool = True) -> Served:
    """Compose, build the method, warm it up (outside timing) and re-time an emulated link, as run.py does."""
    import torch
    from transformers import AutoTokenizer

    from specter.assembly.load_ratio import calibrate_after_warmup
    from specter.assembly.methods import build_method
    from specter.assembly.runtime import model_checkpoint
    from specter.quiet import quiet_loggers, set_verbose
    from specter.speculative.sampling import make_generator

    cfg = compose_checked(overrides)
    if cfg.hardware.get("threads"):
        torch.set_num_threads(int(cfg.hardware.threads))
    checkpoint = model_checkpoint(cfg)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if cfg.verbose:
        set_verbose(True)
    else:
        quiet_loggers()
    method = build_method(cfg, checkpoint)
    try:
        batch = largest_fitting_batch(method, max_batch)
        if warm and cfg.warmup_tokens > 0:  # kernels, allocator, caches, the planner's estimates
            ids = tokenizer("def warm_up(x):", add_special_tokens=False).input_ids or [1]
            method.generate(torch.tensor([ids], device=method.device), int(cfg.warmup_tokens),
                            make_generator(method.device, 0))
            method.warmed()
            calibrate_after_warmup(cfg, checkpoint, method)
            method.reset()
    except BaseException:
        method.close()
        raise
    return Served(cfg, checkpoint, method, tokenizer, int(cfg.model.context_length), batch)


# ---------------------------------------------------------------------------------- request loops and text
class TextStream:
    """Text of a growing token sequence, released piece by piece once its bytes form whole characters.

    The whole sequence is decoded each time (not token by token): tokenizers merge spaces and byte
    pieces across token boundaries, so per-token decoding can differ from decoding the sequence."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        out, self.sent = text[self.sent:], len(text)
        return out


# ---------------------------------------------------------------------------------- the engine
class Engine:
    """A loaded method: `generate`, `stream`, `close` (also a context manager)."""

    def __init__(self, served: Served):
        self.served = served
        self._closed = False
        from specter.scheduler import batches

        # a method with a batched request loop decodes several prompts together (the one scheduler,
        # specter/scheduler.py, as specter serve does); any other is decoded whole, one prompt at a time
        self._batched_loop = batches(served.method)

    # -- properties
    @property
    def method(self) -> Any:
        return self.served.method

    @property
    def tokenizer(self) -> Any:
        return self.served.tokenizer

    @property
    def cfg(self) -> Any:
        return self.served.cfg

    @property
    def max_batch(self) -> int:
        return self.served.max_batch

    @property
    def name(self) -> str:
        """The model name (the config's), as the HTTP server's clients send it."""
        return self.served.name

    @property
    def context_length(self) -> int:
        return self.served.context_length

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"batch up to {self.max_batch}"
        return f"<specter.Engine {self.served.name} {self.method.name} {self.cfg.memory.name} tier, {state}>"

    # -- lifetime
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.served.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- decoding
    def generate(self, prompts: str | Iterable[str], max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 ignore_eos: bool = False) -> list[Completion]:
        """One Completion per prompt, in order. Prompt i samples from seed + i (default: the config's
        seed); temperature 0 is greedy. Unset settings come from the configuration."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("generate needs at least one prompt")
        job = self._job(prompts, max_new_tokens, temperature, top_p, seed, ignore_eos)
        return [done for done in self._decode(job, on_piece=None) if done is not None]

    def stream(self, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, seed: int | None = None, ignore_eos: bool = False) -> Stream:
        """The text of one prompt's output, piece by piece as windows commit (`Stream.result` afterwards)."""
        if not isinstance(prompt, str):
            raise ConfigError(f"stream takes one prompt (a string), got {type(prompt).__name__}")
        job = self._job([prompt], max_new_tokens, temperature, top_p, seed, ignore_eos)
        pieces = _Pieces(self, job)
        stream = pieces.stream = Stream(pieces)
        return stream

    # -- internals
    def _job(self, prompts: list[str], max_new_tokens, temperature, top_p, seed, ignore_eos) -> _Job:
        """Checked settings and token ids, refused with a ConfigError before anything decodes."""
        if self._closed:
            raise EngineClosed("this engine is closed; load a new one")
        cfg = self.cfg
        n = int(cfg.max_new_tokens) if max_new_tokens is None else max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        t = float(cfg.temperature) if temperature is None else temperature
        p = float(cfg.top_p) if top_p is None else top_p
        for name, v in (("temperature", t), ("top_p", p)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
        try:  # the range every entry point shares (sampling_params above)
            params = sampling_params(float(t), float(p), int(cfg.top_k))
        except (ValueError, OverflowError) as err:
            raise ConfigError(str(err) if isinstance(err, ValueError) else f"temperature and top_p must be finite "
                              f"numbers, got {t!r}, {p!r}") from None
        s = int(cfg.seed) if seed is None else seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s or s + len(prompts) > SEED_LIMIT:
            raise ConfigError(f"seed must be an integer in [0, 2**31 - number of prompts), got {seed!r}")
        if not isinstance(ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        ids = [self._tokens(i, text, n) for i, text in enumerate(prompts)]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stop = frozenset() if ignore_eos or eos is None else frozenset([eos])
        return _Job(prompts, ids, n, params, s, stop)

    def _tokens(self, i: int, text: Any, n: int) -> list[int]:
        if not isinstance(text, str):
            raise ConfigError(f"prompt {i} is a {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ConfigError(f"prompt {i} is not valid Unicode (a lone surrogate at character {err.start})") from None
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ConfigError(f"prompt {i} has no tokens")
        ctx = int(self.served.context_length)
        if len(ids) + n > ctx:
            raise ConfigError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={n} it exceeds "
                              f"{self.served.name}'s context of {ctx} tokens")
        if not self._batched_loop:  # a whole-sequence method sizes its caches from the run's protocol
            room = int(self.cfg.prefix_tokens) + int(self.cfg.max_new_tokens)
            if len(ids) + n > room:
                raise ConfigError(f"prompt {i} has {len(ids)} tokens: {self.method.name} was loaded for "
                                  f"prefix_tokens + max_new_tokens = {room}; load it with prefix_tokens= and "
                                  "max_new_tokens= that hold the prompt and the output")
        return ids

    def _decode(self, job: _Job, on_piece=None) -> Iterator[Completion | None]:
        """Completions of `job`'s prompts in order, with None after each window that completed none (so a
        caller can hand out ``on_piece``'s text as it commits: prompt 0's, piece by piece)."""
        if not self._batched_loop:
            for i in range(len(job.prompts)):
                yield self._whole(job, i, on_piece)
            return
        yield from self._batched(job, on_piece)

    def _batched(self, job: _Job, on_piece) -> Iterator[Completion | None]:
        """The prompts through the one request scheduler (specter/scheduler.py), stepped in this thread:
        at most `max_batch` decode together, each leaves at its length or a stop token, a failed window
        shared by several resumes each alone (the failing prompt raises DecodeError)."""
        from specter.scheduler import Job, Scheduler

        sched = Scheduler(self.method, self.max_batch)
        text0 = TextStream(self.tokenizer)
        done_at: dict[int, float] = {}

        def emit(i: int) -> Any:
            def on_tokens(ids: list[int], reason: str | None) -> None:
                if i == 0 and on_piece is not None:
                    on_piece(text0.push(ids, final=reason is not None))
                if reason is not None:
                    done_at[i] = time.perf_counter()
            return on_tokens

        jobs = [Job(ids, job.max_new, job.params, emit(i), seed=job.seed + i, stop_ids=job.stop)
                for i, ids in enumerate(job.ids)]
        for j in jobs:
            sched.add(j)
        io0 = _io_now(self.method)
        t0 = time.perf_counter()
        nxt = 0
        try:
            while nxt < len(jobs):
                sched.step()
                if jobs[nxt].finish is None:
                    yield None  # a window passed
                while nxt < len(jobs) and jobs[nxt].finish is not None:  # in order, as soon as each is complete
                    j = jobs[nxt]
                    if j.finish == "error":
                        raise DecodeError(f"prompt {nxt} failed while decoding: {j.error}")
                    yield self._completion(job, nxt, j, done_at[nxt] - t0, io0, sched.peak)
                    nxt += 1
        finally:
            sched.abandon()

    def _completion(self, job: _Job, i: int, done: Any, wall: float, io0: tuple[int, ...],
                    batch: int) -> Completion:
        from specter.speculative.engine import acceptance_stats

        io1 = _io_now(self.method)
        req, n, windows = done.req, done.sent, done.windows  # after a resumption: its last decoder's request
        alpha = acceptance_stats(req.drafted, req.accepted)["acceptance_alpha"] if req.drafted else None
        d = [b - a for a, b in zip(io0, io1)]
        stats = Stats(n, wall, req.clock.latency()["tpot_ms"], n / windows if windows else None, alpha,
                      *(d if self.method.rt is not None else (None,) * 4), batch=batch)
        tokens = list(done.emitted[:n])
        return Completion(job.prompts[i], self.tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                          done.finish, stats)

    def _whole(self, job: _Job, i: int, on_piece) -> Completion:
        """A method with no request loop: its `generate` over the whole output at once."""
        import torch

        from specter.speculative.sampling import make_generator

        method = self.method
        t0 = time.perf_counter()
        gen = method.generate(torch.tensor([job.ids[i]], device=method.device), job.max_new,
                              make_generator(method.device, job.seed + i))
        wall = time.perf_counter() - t0
        tokens = list(gen.tokens[:job.max_new])
        cut = next((k for k, t in enumerate(tokens) if t in job.stop), None)
        reason = "length" if cut is None else "stop"
        tokens = tokens if cut is None else tokens[:cut]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if on_piece is not None and i == 0:
            on_piece(text)
        s = gen.stats
        windows = s.get("iterations")
        offloads = "h2d_bytes" in s
        io = (s.get("h2d_bytes"), s.get("loads"), s.get("demand_hits"), s.get("demand_misses")) if offloads \
            else (None,) * 4
        stats = Stats(len(tokens), wall, gen.clock.latency()["tpot_ms"],
                      len(gen.tokens) / windows if windows else None, s.get("acceptance_alpha"), *io)
        return Completion(job.prompts[i], text, tokens, reason, stats)


@dataclass(frozen=True)
class _Job:
    prompts: list[str]
    ids: list[list[int]]
    max_new: int
    params: Any  # SamplingParams
    seed: int
    stop: frozenset[int]


class _Pieces:
    """The iterator behind a Stream: runs the decode generator, hands out prompt 0's text pieces."""

    def __init__(self, engine: Engine, job: _Job):
        self.stream: Stream | None = None
        self._buffer: list[str] = []
        self._gen = engine._decode(job, on_piece=self._buffer.append)
        self._finished = False

    def __iter__(self) -> _Pieces:
        return self

    def __next__(self) -> str:
        while True:
            while self._buffer:
                piece = self._buffer.pop(0)
                if piece:
                    return piece
            if self._finished:
                raise StopIteration
            try:
                done = next(self._gen)
            except StopIteration:
                self._finished = True
                continue
            if done is not None and self.stream is not None:
                self.stream.result = done

    def close(self) -> None:
        self._finished = True
        self._gen.close()


def _io_now(method: Any) -> tuple[int, int, int, int]:
    """(link bytes, expert loads, demand hits, demand misses) so far; zeros with no offloading runtime."""
    rt = method.rt
    if rt is None:
        return 0, 0, 0, 0
    c = rt.cache.snapshot_counters()
    return int(rt.link.bytes_copied), int(c["loads"]), int(c["demand_hits"]), int(c["demand_misses"])
