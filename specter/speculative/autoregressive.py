"""Autoregressive decoding, one token per forward pass, with a commit clock.

Used by `target_only` (the full model on the device) and `offload_ar` (the same loop over the
offloading runtime), on either decode path: a transformers model with a DynamicCache, or the
compact decoder with its StaticKVCache. No EOS stop: every record generates exactly
`max_new_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specter.metrics import CommitClock
from specter.models.compat import accept_cache_argument
from specter.speculative.sampling import SamplingParams, next_token
from specter.speculative.state import new_kv_cache


@torch.inference_mode()
def generate_autoregressive(
    model: Any,  # a transformers model, or the compact decoder over one
    prompt_ids: torch.Tensor,  # [1, P]
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    clock: CommitClock | None = None,
    on_step: Callable[[], None] | None = None,  # called before every forward (a window per step)
) -> list[int]:
    clock = clock or CommitClock()
    if isinstance(model, torch.nn.Module):
        accept_cache_argument(model)  # a model loaded by the caller, on a transformers that names it past_key_values
    cache = new_kv_cache(model, prompt_ids.shape[1] + max_new_tokens)
    step_fn = on_step or (lambda: None)
    clock.start()
    step_fn()
    logits = model(input_ids=prompt_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]  # [V]
    tokens: list[int] = []
    step = torch.empty(1, 1, dtype=prompt_ids.dtype, device=prompt_ids.device)  # [1, 1] reused input
    while True:
        tok = next_token(logits, params, generator)
        tokens.append(tok)
        clock.commit(1)
        if len(tokens) == max_new_tokens:
            return tokens
        step.fill_(tok)
        step_fn()
        logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]
