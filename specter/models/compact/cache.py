"""A preallocated key/value cache, rolled back by length.

One `[B, H_kv, S_max, D]` key buffer and one `[B, H_kv, S_max, D_v]` value buffer per decoder
layer (no value buffer when the values are a view of the keys, as in MLA's latent cache), allocated once; a forward writes its T new positions at `length` and advances it. Rolling
back is setting `length` (nothing is freed or copied), so the speculative state manager can drop
draft scratch or a rejected suffix for free. The buffers never move, which is what a captured
CUDA graph needs.

`get_seq_length()` and `crop(-n)` mirror the subset of transformers' `DynamicCache` that
`specter.speculative.state.SequenceKV` uses, so the same single-request rows can hold either cache.
"""

from __future__ import annotations

import torch

from specter.models.compact.ops import seq


class CacheFull(RuntimeError):
    """A forward would write past the preallocated length."""


class StaticKVCache:
    """Per-layer key/value buffers of a fixed capacity and one shared committed length."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, key_dim: int, value_dim: int, capacity: int,
                 device: torch.device, dtype: torch.dtype, grow: bool = True):
        self.capacity = capacity
        self.grow = grow  # reallocate (double) when full; a captured graph's cache must not grow
        self.keys = [torch.zeros(batch, kv_heads, capacity, key_dim, device=device, dtype=dtype)
                     for _ in range(num_layers)]  # L x [B, H_kv, S_max, D]
        self.values = [torch.zeros(batch, kv_heads, capacity, value_dim, device=device, dtype=dtype)
                       for _ in range(num_layers)] if value_dim else []  # L x [B, H_kv, S_max, D_v]; none
        # when values are a view of the keys (DeepSeek-V2's latent cache)
        self.length = 0

    # -- the DynamicCache subset the state manager uses -----------------------------------------
    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def crop(self, n: int) -> None:
        """`crop(-n)` drops the last n positions; `crop(m)` with m >= 0 keeps the first m."""
        self.rollback(self.length + n if n < 0 else min(n, self.length))

    # -- length bookkeeping ---------------------------------------------------------------------
    def rollback(self, length: int) -> None:
        """Keep the first `length` positions (KV past it is stale and overwritten by the next write)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more positions (doubling), or raise when growing is off."""
        need = self.length + extra
        if need <= self.capacity:
            return
        if not self.grow:
            raise CacheFull(f"KV cache holds {self.capacity} positions; {need} needed")
        new = max(need, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                b, h, _, d = old.shape
                buf = old.new_zeros(b, h, new, d)
                buf[:, :, :self.length] = old[:, :, :self.length]
                buffers[i] = buf
        self.capacity = new

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T new positions of `layer` at `length` (call `reserve(T)` first) and return the
        keys/values of positions [0, length + T) as views."""
        t = key.shape[2]  # key [B, H_kv, T, D], value [B, H_kv, T, D_v]
        end = self.length + t
        k, v = self.keys[layer], self.values[layer]
        seq(k, self.length, t).copy_(key)
        seq(v, self.length, t).copy_(value)
        return seq(k, 0, end), seq(v, 0, end)  # [B, H_kv, length+T, D], [B, H_kv, length+T, D_v]

    def advance(self, t: int) -> None:
        """After every layer wrote its T positions: they are now part of the cache."""
        self.length += t

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.keys + self.values)
