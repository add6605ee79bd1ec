"""Calling a compiled static step's graph without dynamo's per-call work.

Every call of a `torch.compile`d function goes through dynamo: its guards, then bytecode that loads
each of the graph's inputs (60-80 weight tensors of a tiny model, by attribute chains) before the
compiled graph runs. On a one-token decode step of a CPU this was a third of the step's time
(measured: 1.4-1.5x the graph called alone). A static step's graph inputs never change
except for its own arguments (the step owns its weights and KV buffers, see static.py), so once
dynamo has traced and run a graph, the step can call that graph directly:

    backend = recording_backend(options, seen)         # inductor, remembering each graph and its inputs
    fn = torch.compile(step, backend=backend, ...)
    fn(*args)                                          # dynamo traces, runs, and leaves (graph, inputs) in seen
    call = DirectCall.learn(seen, args)                # None when the inputs cannot be mapped back
    call(*next_args)                                   # the same graph, its inputs rebuilt from next_args

`learn` maps each graph input to the step argument it *is* (identity: the token, position, span,
each KV buffer, the rope tables), to the span's length (the one dynamic size), or else keeps it as
a constant (a weight, a constant tensor of the step). Anything it cannot place, or a step argument
the graph never received (a stale record: dynamo ran no graph for this call), makes it refuse, and
the step keeps calling through dynamo. The dynamo-called graph is the reference: tests compare the
two over positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def recording_backend(options: dict, seen: list) -> Callable:
    """A torch.compile backend: Inductor with `options` (its config patches), and each compiled
    graph's call leaves `[graph, inputs]` in `seen`."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graph = compile_fx(gm, example_inputs, config_patches=options)

        def call(*inputs):
            seen[:] = [graph, inputs]
            return graph(*inputs)
        return call
    return backend


def _flat(args: Sequence[Any]) -> list[torch.Tensor]:
    """The step's tensor arguments in order, lists (the KV buffers) spread out."""
    out: list[torch.Tensor] = []
    for a in args:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


class DirectCall:
    """One compiled graph and a template of its inputs: constants in place, the step's arguments
    (and the span length) filled in per call."""

    def __init__(self, graph: Callable, template: list, slots: list[tuple[int, int]], length_slot: int | None,
                 span_index: int):
        self.graph, self.template, self.slots = graph, template, slots  # slots: (input index, flat argument index)
        self.length_slot, self.span_index = length_slot, span_index

    @classmethod
    def learn(cls, seen: list, args: Sequence[Any], dynamic_length: bool, span_index: int = 2) -> DirectCall | None:
        """From the inputs dynamo just passed to a graph (`seen`) and the step's arguments of that call;
        None when some input is neither an argument, the span length, nor a tensor constant, or when
        `dynamic_length` (the graph must serve every span length) and the graph has no length input
        (dynamo specialised it to this one)."""
        if len(seen) != 2:
            return None
        graph, inputs = seen
        flat = _flat(args)
        where = {id(t): i for i, t in enumerate(flat)}
        span_length = flat[span_index].shape[0]
        template, slots, length_slot = list(inputs), [], None
        for k, value in enumerate(inputs):
            if isinstance(value, torch.Tensor):
                if id(value) in where:
                    slots.append((k, where[id(value)]))
            elif isinstance(value, int) and value == span_length and length_slot is None:
                length_slot = k  # the span's dynamic length, a SymInt of the graph
            else:
                return None  # another size or value: only dynamo knows where it comes from
        if dynamic_length and length_slot is None:
            return None
        if {i for _, i in slots} != set(range(len(flat))):
            return None  # some argument never reached this graph: not the graph of this call
        return cls(graph, template, slots, length_slot, span_index)

    def __call__(self, *args: Any) -> torch.Tensor:
        flat = _flat(args)
        inputs = self.template.copy()
        for k, i in self.slots:
            inputs[k] = flat[i]
        if self.length_slot is not None:
            inputs[self.length_slot] = flat[self.span_index].shape[0]
        out = self.graph(*inputs)
        return out[0] if isinstance(out, (list, tuple)) else out
