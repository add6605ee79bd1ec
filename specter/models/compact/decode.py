"""Decoding loops over the compact model: autoregressive generation and the verification-window step.

    generate_compact(model, prompt [1,P], n, pick)    one preallocated cache, one forward per token
    verify_window(model, cache, window [B, K+1])      K+1 positions in one pass (logits for each)
    cache.rollback(length)                            forget every position past `length`

`pick(logits [V]) -> int` chooses the next token (greedy or sampled), so this module needs
nothing from the sampling code. No EOS stop, as in `specter.speculative.autoregressive`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specter.metrics import CommitClock
from specter.models.compact.cache import StaticKVCache
from specter.models.compact.model import CompactCausalLM


@torch.inference_mode()
def generate_compact(model: CompactCausalLM, prompt_ids: torch.Tensor, max_new_tokens: int,
                     pick: Callable[[torch.Tensor], int], clock: CommitClock | None = None,
                     cache: StaticKVCache | None = None) -> list[int]:
    """Greedy or sampled decoding of `max_new_tokens` tokens after prompt_ids [1, P]."""
    clock = clock or CommitClock()
    if cache is None:
        cache = model.new_cache(prompt_ids.shape[1] + max_new_tokens)
    else:
        cache.reset()
    clock.start()
    logits = model.forward(prompt_ids, cache, last_only=True)[0, -1]  # [V]
    tokens: list[int] = []
    step = torch.empty(1, 1, dtype=prompt_ids.dtype, device=prompt_ids.device)  # [1, 1] reused input
    while True:
        tok = pick(logits)
        tokens.append(tok)
        clock.commit(1)
        if len(tokens) == max_new_tokens:
            return tokens
        step.fill_(tok)
        logits = model.forward(step, cache)[0, -1]  # [V]


@torch.inference_mode()
def verify_window(model: CompactCausalLM, cache: StaticKVCache, window: torch.Tensor) -> torch.Tensor:
    """Target logits [B, K+1, V] for a verification window [B, K+1] appended at cache.length.

    The window's KV stays in the cache; after acceptance, `cache.rollback(committed)` keeps only
    the accepted positions (the next window overwrites the rest)."""
    return model.forward(window, cache)
