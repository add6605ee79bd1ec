"""Autoregressive decoding, one token per forward pass, with a commit clock.

Used by `target_only` (the full model on the device) and `offload_ar` (the same loop over the
offloading runtime). No EOS stop: every record generates exactly `max_new_tokens` tokens.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specter.metrics import CommitClock
from specter.models.compat import accept_cache_argument
from specter.speculative.sampling import SamplingParams, next_token


@torch.inference_mode()
def generate_autoregressive(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [1, P]
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    clock: CommitClock | None = None,
) -> list[int]:
    clock = clock or CommitClock()
    accept_cache_argument(model)  # a model loaded by the caller, on a transformers that names it past_key_values
    cache = DynamicCache(config=model.config)
    clock.start()
    logits = model(input_ids=prompt_ids, cache=cache, use_cache=True).logits[0, -1]  # [V]
    tokens: list[int] = []
    while True:
        tok = next_token(logits, params, generator)
        tokens.append(tok)
        clock.commit(1)
        if len(tokens) == max_new_tokens:
            return tokens
        step = torch.tensor([[tok]], device=prompt_ids.device)
        logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]
