"""One place for what differs between the transformers versions the project runs under.

The engine passes the KV cache as `cache=` (transformers >= 5.2x names the argument so). Older 5.x
releases — 5.17 is the GPU image's — call it `past_key_values` and silently ignore an unknown
`cache=`: every step would then run without the cache it was given. `accept_cache_argument`
gives such a model a forward pre-hook that hands `cache=` over under the old name, so the same
call works on both.
"""

from __future__ import annotations

import inspect

import torch


def cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes its KV cache by: "cache" or "past_key_values"."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def _rename_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if "cache" in kwargs:
        kwargs["past_key_values"] = kwargs.pop("cache")
    return args, kwargs


def accept_cache_argument(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself, taking `cache=` whatever its transformers version calls the argument (idempotent)."""
    if cache_argument(model) == "past_key_values" and not getattr(model, "_specter_cache_hook", False):
        model.register_forward_pre_hook(_rename_cache, with_kwargs=True)
        model._specter_cache_hook = True
    return model
