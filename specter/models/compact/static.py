"""The one-token decode step with static shapes: what `torch.compile` and CUDA graphs capture.

`CompactCausalLM.forward` handles any (B, T) with Python-int positions and views sized to the
cache's length, so every step has a new shape. `StaticStep` runs the same layers for B = T = 1
with the position as a tensor: KV written with `index_copy_` at `pos`, attention over a span of
the preallocated buffer under an additive mask (positions past `pos`, and outside a sliding
window, get -inf), rope rows gathered at `pos`, and the routed experts as indexed reductions
(`GatheredExperts`) instead of a Python loop over `.tolist()` indices. Nothing in it reads a
tensor back to the host. The span is the whole buffer on CUDA (one shape: a CUDA graph replays
it) and the live prefix 0..pos on a CPU (a dynamic length: one trace for every position, and
attention reads no more than the positions written).

    step = StaticStep(compact, compile=True)     # eager when compile=False (the reference of the compiled step)
    logits = step(token [1, 1], cache)           # [1, 1, V]; advances cache.length by one
    use_static_step(compact)                     # or: compact's own one-token forwards go through it

The step owns its caches: `cache(capacity)` hands out one buffer set per (batch, rounded
capacity), reset to length 0, so the traced (or graph-captured) buffers never change address and
one sequence at a time decodes through a static decoder, as target_only does. On a CPU, once
dynamo has run a trace, the step calls the compiled graph itself (`direct.DirectCall`): dynamo's
per-call guards and input loading were a third of the step.

Only blocks whose experts are all on the device (a plain transformers experts module, as in
target_only) have a static form; an offloading experts callable decides residency on the host
and keeps the eager step (`static_problem` says why).
"""

from __future__ import annotations

import copy
import itertools
import types

import torch

from specter.models.compact.attention import StaticTokens
from specter.models.compact.cache import StaticKVCache
from specter.models.compact.direct import DirectCall, recording_backend
from specter.models.compact.model import CompactCausalLM
from specter.models.compact.moe import DenseMLP
from specter.models.compact.ops import FusedExperts, GatheredExperts, rope_tables

CAPACITY_QUANTUM = 256  # static caches are allocated in multiples of this, so a few traces cover every record
_INSTANCES = itertools.count()


def use_static_step(model: CompactCausalLM, compile: bool = True) -> CompactCausalLM:
    """Send every one-token forward of `model` through a `StaticStep` (compiled unless compile=False);
    its caches then come from the step (`StaticStep.cache`). ValueError when some layer's experts
    are not resident."""
    model.static = StaticStep(model, compile=compile)
    return model


def static_problem(model: CompactCausalLM) -> str | None:
    """Why `model` has no static step (an experts callable other than `FusedExperts`), or None."""
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(experts, FusedExperts):
            return (f"layer {i}'s experts are {type(experts).__name__}, which decides residency on the host; "
                    "only fully resident experts (target_only) have a static step")
    return None


def static_capacity(n: int) -> int:
    """The capacity a static cache for n positions gets (rounded up, so records share a trace)."""
    return -(-max(n, 1) // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def _own_code(method):
    """`method` bound to a private copy of its function's code object (dynamo's trace cache lives on
    the code object; without a copy, every StaticStep would share one)."""
    f = method.__func__
    n = next(_INSTANCES)
    code = f.__code__.replace(co_name=f"{f.__name__}_{n}", co_qualname=f"{f.__qualname__}_{n}")
    return types.MethodType(types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__),
                            method.__self__)


def _guard_arguments_only(entries) -> list[bool]:
    """Keep dynamo's guards on the step's arguments (token, position, KV buffers, rope tables: a new
    capacity retraces) and drop the ~100 on `self`'s weights and constants, which a StaticStep owns
    and never reassigns; checking them cost a third of a tiny model's step. Safe because every
    instance traces its own copy of `step`'s code (`_own_code`): dynamo keeps its traces per code
    object, so one model's trace never serves another."""
    return [not (e.name == "self" or e.name.startswith("self.")) for e in entries]


def compile_options(device: torch.device) -> dict:
    """Inductor options for the static step: on CPU a C++ wrapper (no Python between kernels); on
    CUDA, CUDA graphs (the step replays as one graph)."""
    options = {"size_asserts": False}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True
    else:
        options["cpp_wrapper"] = True
    return options


class StaticStep:
    """One-token decode over a `CompactCausalLM`'s layers with static shapes (see the module docstring)."""

    def __init__(self, model: CompactCausalLM, compile: bool = False):
        problem = static_problem(model)
        if problem:
            raise ValueError(problem)
        self.model = model
        self.mlps = [self._static_mlp(layer.mlp) for layer in model.layers]
        self.neg_inf = torch.tensor(float("-inf"), dtype=model.dtype, device=model.device)
        self.zero = torch.zeros((), dtype=model.dtype, device=model.device)
        self.compiled = compile
        self.caches: dict[tuple[int, int], StaticKVCache] = {}
        self.tables: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]] = {}
        self.fn = self.step
        # On a CPU, once dynamo has run a trace, the step calls its graph directly (direct.py); under
        # CUDA graphs the replay already removes the per-call cost, so dynamo keeps calling.
        self.direct_calls = compile and model.device.type == "cpu"
        self.calls: dict[tuple[int, bool], object] = {}  # (capacity, first position) -> DirectCall or self.fn
        self._seen: list = []
        if compile:
            self.fn = torch.compile(_own_code(self.step), fullgraph=True, dynamic=None,
                                    backend=recording_backend(compile_options(model.device), self._seen),
                                    options={"guard_filter_fn": _guard_arguments_only})

    def cache(self, capacity: int, batch: int = 1) -> StaticKVCache:
        """This step's cache for `capacity` positions (rounded up to CAPACITY_QUANTUM), empty. The same
        buffers every time: a previous holder of it sees it reset."""
        if batch != 1:
            raise ValueError("the static step decodes one sequence (batch 1)")
        key = (batch, static_capacity(capacity))
        if key not in self.caches:
            m = self.model
            cache = StaticKVCache(m.num_layers, batch, m.kv_heads, m.key_dim, m.value_dim, key[1], m.device, m.dtype)
            self._pin(cache)
            self.caches[key] = cache
        cache = self.caches[key]
        cache.reset()
        return cache

    def _pin(self, cache: StaticKVCache) -> None:
        """CUDA graphs replay fixed addresses: tell the compiler the KV buffers are static inputs. On a
        CPU keep their sizes static (a new capacity is a new trace, not a dynamic size: direct calls
        map one dynamic size only, the span's length)."""
        if not self.compiled:
            return
        for buf in cache.keys + cache.values:
            if self.model.device.type == "cuda":
                torch._dynamo.mark_static_address(buf)
            else:
                torch._dynamo.mark_static(buf)

    @staticmethod
    def _static_mlp(mlp):
        if isinstance(mlp, DenseMLP) or not isinstance(getattr(mlp, "experts", None), FusedExperts):
            return mlp
        static = copy.copy(mlp)  # the same router and shared-expert tensors, experts as indexed reductions
        static.experts = GatheredExperts.of(mlp.experts)
        return static

    def step(self, token: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, keys: list[torch.Tensor],
             values: list[torch.Tensor], cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
        """token [1, 1], pos [1], span [n] (the positions 0..n-1 attention reads) -> logits [1, V];
        writes this position's KV into the buffers."""
        m = self.model
        seen = span <= pos  # [n]
        if m.window is not None:
            seen = seen & (span > pos - m.window)
        z = StaticTokens(pos, cos_table.index_select(0, pos), sin_table.index_select(0, pos),
                         torch.where(seen, self.zero, self.neg_inf), keys, values, span.shape[0])
        x = m.embed[token.view(-1)]  # [1, H]
        for layer, mlp in zip(m.layers, self.mlps):
            x = x + layer.attn.static_token(layer.attn_norm(x), z)
            x = x + mlp(layer.mlp_norm(x))
        return m.head(m.norm(x))  # [1, V]

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """token [1, 1] at position cache.length -> logits [1, 1, V]; advances the cache by one."""
        if cache.length >= cache.capacity:
            cache.reserve(1)  # a full cache doubles (new buffers: one retrace)
            self._pin(cache)
        positions, spans, cos, sin = self.tables.get(cache.capacity) or self._tables(cache.capacity)
        n = cache.length
        args = (token, positions[n], spans[n], cache.keys, cache.values, cos, sin)
        call = self.calls.get((cache.capacity, n == 0)) if self.direct_calls else None
        if call is not None:
            logits = call(*args)
        else:
            self._seen.clear()  # what the backend records next is this call's graph, or nothing
            logits = self.fn(*args)
            if self.direct_calls:  # the trace (span length 1 is its own) has run: call its graph from now on
                direct = DirectCall.learn(self._seen, args, dynamic_length=n > 0)
                self.calls[(cache.capacity, n == 0)] = direct or self.fn
        cache.advance(1)
        return logits.view(1, 1, -1)

    def _tables(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Per capacity, made once: a [1] position tensor per position and the span attention reads at
        it (no tensor is built per step), and rope rows for every position of the buffer.

        On a CPU the span at position p is 0..p, of a dynamic length (one trace for every length):
        attention reads only the live prefix. Under CUDA graphs shapes must not change, so the span
        is the whole buffer and the mask hides what is not yet written."""
        m = self.model
        if m.rope.length < capacity:
            m.rope.cos, m.rope.sin = rope_tables(m.rotary, capacity, m.device, m.dtype, complex_form=m.mla)
        every = torch.arange(capacity, device=m.device)  # [S_max]
        positions = list(every.view(-1, 1).unbind(0))  # S_max x [1]
        if self.model.device.type == "cuda":
            spans = [every] * capacity
        else:
            spans = [every[:p + 1] for p in range(capacity)]  # S_max x [p+1]
            if self.compiled:
                for span in spans[1:]:  # length 1 is specialised by the compiler (its own trace)
                    torch._dynamo.maybe_mark_dynamic(span, 0)
        cos, sin = m.rope.cos[:capacity], m.rope.sin[:capacity]
        if self.compiled and self.model.device.type != "cuda":
            torch._dynamo.mark_static(cos)  # sized by the capacity: a new one is a new trace (see _pin)
            torch._dynamo.mark_static(sin)
        self.tables[capacity] = (positions, spans, cos, sin)
        return self.tables[capacity]
