"""State manager: one target-authoritative KV cache and the committed token sequence.

Each iteration starts from a committed prefix x_1..x_n whose KV is cached for x_1..x_{n-1}; the
last committed token x_n is the first uncached input. The draft appends its K scratch positions
to the same cache (no second copy of the prefix), which are dropped before verification; the
target then computes KV for the K+1 verified positions, and commit keeps only the accepted ones.
The corrected or bonus token becomes the next uncached input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import DynamicCache


def new_kv_cache(model: Any, capacity: int = 0) -> Any:
    """An empty KV cache for `model`: its own `new_cache(capacity)` (the compact decoder), else a DynamicCache."""
    if hasattr(model, "new_cache"):
        return model.new_cache(max(capacity, 16))
    return DynamicCache(config=model.config)


@dataclass
class SequenceState:
    """Per-request state (batch-ready: one of these per sequence)."""

    cache: Any  # DynamicCache, or the compact decoder's StaticKVCache
    tokens: list[int] = field(default_factory=list)  # committed generated tokens
    committed_kv: int = 0  # positions whose target KV is authoritative

    @classmethod
    def new(cls, model: Any, capacity: int = 0) -> "SequenceState":
        """A fresh sequence on `model`'s kind of cache: transformers' DynamicCache, or the compact
        decoder's preallocated StaticKVCache (`capacity` positions, grown if a request needs more)."""
        return cls(new_kv_cache(model, capacity))

    def kv_length(self) -> int:
        return self.cache.get_seq_length()

    def discard_extension(self) -> None:
        """Drop every position past the committed prefix (draft scratch or rejected suffix)."""
        extra = self.kv_length() - self.committed_kv
        if extra > 0:
            self.cache.crop(-extra)

    def start(self, prompt_len: int, first_token: int) -> None:
        """After the target's prefill: the prompt's KV is committed, its next token is uncached."""
        self.committed_kv = prompt_len
        self.tokens = [first_token]
        self.discard_extension()

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def commit(self, accepted: list[int], next_token: int) -> None:
        """Keep target KV for the last uncached input + the accepted drafts; queue the next token."""
        self.committed_kv += 1 + len(accepted)
        self.tokens.extend(accepted)
        self.tokens.append(next_token)
        self.discard_extension()
