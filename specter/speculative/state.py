"""Single-request KV state: one target-authoritative cache, the B = 1 rows of the window loop.

Each iteration starts from a committed prefix x_1..x_n whose KV is cached for x_1..x_{n-1}; the
last committed token x_n is the first uncached input. The draft appends its K scratch positions
to the same cache (no second copy of the prefix), which are dropped before verification; the
target then computes KV for the K+1 verified positions, and commit keeps only the accepted ones.
The corrected or bonus token becomes the next uncached input.

`SequenceKV` speaks `batch_state.BatchKV`'s protocol (prefill_inputs / run / discard_pending /
commit / select / merge) for one row on the decode path's own cache (the compact decoder's
preallocated StaticKVCache, or a DynamicCache): no padding, holes, masks or per-row positions,
so it runs the compact decoder, which takes none of them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def new_kv_cache(model: Any, capacity: int = 0) -> Any:
    """An empty KV cache for `model`: its own `new_cache(capacity)` (the compact decoder), else a DynamicCache."""
    if hasattr(model, "new_cache"):
        return model.new_cache(max(capacity, 16))
    return DynamicCache(config=model.config)


class SequenceKV:
    """One request's KV on `model`'s kind of cache (`capacity` positions preallocated where it
    preallocates; grown if the request needs more)."""

    compactions = 0  # nothing to compact: rollback is a crop

    def __init__(self, model: Any, capacity: int = 0):
        self.model, self.capacity = model, capacity
        self.cache: Any = None  # None: no request holds these rows
        self.committed = 0  # positions whose target KV is authoritative
        self.prefilling = False

    @property
    def batch_size(self) -> int:
        return int(self.cache is not None)

    @property
    def pending(self) -> int:
        """Positions past the committed prefix (draft scratch or a verified window)."""
        return self.cache.get_seq_length() - self.committed if self.cache is not None else 0

    def prefill_inputs(self, prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, None]:
        """``(input_ids [1, P], token_valid=None)`` for the one prompt; its KV is committed by the next `run`."""
        if len(prompts) != 1 or self.cache is not None:
            raise ValueError(f"single-request rows hold one request; got {len(prompts)} prompt(s) "
                             f"{'beside a running one' if self.cache is not None else ''}".rstrip())
        self.cache, self.prefilling = new_kv_cache(self.model, self.capacity), True
        return prompts[0].reshape(1, -1), None

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, T, V]`` of ``ids [1, T]``; its T positions stay pending (a prefill's are committed)."""
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True).logits
        if self.prefilling:
            self.committed, self.prefilling = ids.shape[1], False
        return logits

    def discard_pending(self) -> None:
        """Drop every position past the committed prefix."""
        extra = self.pending
        if extra > 0:
            self.cache.crop(-extra)

    def commit(self, keep: list[int]) -> None:
        """Keep the first ``keep[0]`` pending positions (the last input + the accepted drafts)."""
        (k,) = keep
        if not 0 <= k <= self.pending:
            raise ValueError(f"keep must give 0..{self.pending} positions, got {k}")
        self.committed += k
        self.discard_pending()

    def select(self, rows: list[int]) -> None:
        """``[]``: the request left; ``[0]``: it stays."""
        if not rows:
            self.cache, self.committed = None, 0
        elif list(rows) != [0]:
            raise ValueError(f"single-request rows have one row, cannot keep {rows}")

    def merge(self, other: SequenceKV) -> None:
        """Take over ``other``'s prefilled request (these rows must be empty)."""
        if self.cache is not None:
            raise ValueError("single-request rows hold one request at a time: decode more through BatchKV")
        self.cache, self.committed = other.cache, other.committed
