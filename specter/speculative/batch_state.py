"""Batched KV state: one left-padded `DynamicCache` for B requests, with per-request lengths.

Layout. Row b of every cache layer holds request b's KV in columns ``[0, S)``; ``valid [B, S]``
says which columns are real, ``lengths[b]`` how many (its committed positions). A compacted row
is *right-aligned*: its positions occupy its last ``lengths[b]`` columns. A forward over T new
tokens per request appends T columns to every row (the same cache position ``S..S+T-1`` for all
rows), with explicit ``position_ids = lengths[b] + pending + t`` per request and the attention
mask ``[valid | ones]``::

    row 0   pad pad  k0  k1  k2  k3 | d0 d1 d2        lengths 4, pending 3 (draft scratch)
    row 1    k0  k1  k2  k3  k4  k5 | d0 d1 d2        lengths 6

Left padding comes from prompts of different lengths and from requests that join later; holes
(below) from rejected positions.

Per-request rollback. After verification the K+1 pending columns are the same for every row,
but request b keeps only the first ``1 + a_b`` of them. ``commit(keep)`` marks the rest invalid:
they become holes that the mask hides, so nothing is recomputed or copied. Once the cache is
wider than its longest request by more than ``max_holes`` columns, ``compact`` right-aligns every
row with one stable gather per layer and drops the columns no row needs. With the default
``max_holes = 0`` the width never exceeds ``max(lengths) + pending`` (what the memory budget
accounts per request); a shorter row may carry masked holes until the next compaction.

Why this keeps each request's greedy output equal to its own B=1 output: a masked column gets an
attention weight of exactly zero (``exp(-inf)``), so padding and holes contribute nothing to a
request's softmax or to its weighted sum of values; RoPE uses the explicit per-request positions,
not column indices; and every other op (norms, projections, routers, experts) is row-wise. What
can differ is the last bits of a GEMM whose row count changed (B×T rows instead of T), the same
kind of difference the B=1 engine already has between a 1-token draft step and a (K+1)-token
verification (a few 1e-7 on fp32 logits of the tiny models, measured); the tests check token
equality on all three architectures. Padding never changes which tokens a request attends to.

Alternatives considered: per-request caches with a per-request attention call (exact shapes,
but B forward passes and no batched attention), and cropping every row to the shortest accepted
length and recomputing the rest (extra target compute every iteration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specter.metrics import CommitClock


@dataclass
class Request:
    """One request of a batch: committed tokens and per-request accounting (batch-independent)."""

    rid: int  # the caller's id (e.g. the prompt index)
    prompt_len: int
    max_new_tokens: int
    generator: torch.Generator | None = None  # per-request sampling stream
    prompt: list[int] = field(default_factory=list)  # prompt token ids
    clock: CommitClock = field(default_factory=CommitClock)
    tokens: list[int] = field(default_factory=list)  # committed generated tokens; the last is uncached
    drafted: list[int] = field(default_factory=list)  # K_b per speculative iteration
    accepted: list[int] = field(default_factory=list)  # a_b per speculative iteration
    stats: dict[str, Any] = field(default_factory=dict)  # per-request record columns, filled when it finishes

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


def _layers(cache: DynamicCache) -> list:
    """The cache's initialized layers; a layer type the batch layout cannot rearrange is an error."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not getattr(layer, "is_croppable", True):
            raise NotImplementedError(f"batched decoding needs full-attention cache layers, got {type(layer).__name__}")
    return layers


class BatchKV:
    """The batched KV cache, its column validity mask and per-request committed lengths."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_holes: int = 0):
        """The KV of `model`'s batched forwards (transformers' modules: they take per-row positions and masks)."""
        if max_holes < 0:
            raise ValueError(f"max_holes must be >= 0, got {max_holes}")
        self.model = model
        self.config = config = model.config
        self.device = torch.device(device)
        self.max_holes = max_holes
        self.cache = DynamicCache(config=config)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S]
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed positions
        self.pending = 0  # columns appended past the committed state (draft scratch or a verified window)
        self.compactions = 0
        self.prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # a staged prefill's (positions, mask)

    # ------------------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def columns(self) -> int:
        """Cache columns S + pending (equals `cache.get_seq_length()` once a forward ran)."""
        return self.valid.shape[1] + self.pending

    def forward_inputs(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(position_ids [B, T], attention_mask [B, S + pending + T])`` for T new tokens per request."""
        B = self.batch_size
        offsets = torch.arange(self.pending, self.pending + T, device=self.device)  # [T]
        position_ids = self.lengths[:, None] + offsets[None]  # [B, T]
        ones = torch.ones(B, self.pending + T, dtype=torch.bool, device=self.device)
        return position_ids, torch.cat([self.valid, ones], dim=1).long()  # [B, S + pending + T]

    def appended(self, T: int) -> None:
        """Record that a forward appended T columns to every row."""
        self.pending += T

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids [B, T]``: a staged prefill (its columns committed by `valid`),
        else T new pending columns per row."""
        if self.prefill is not None:
            (position_ids, mask), self.prefill = self.prefill, None
        else:
            position_ids, mask = self.forward_inputs(ids.shape[1])
            self.appended(ids.shape[1])
        return self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                          use_cache=True).logits

    # ------------------------------------------------------------------------------ rollback / commit
    def discard_pending(self) -> None:
        """Drop every pending column of every row (the draft scratch): a uniform crop."""
        if self.pending:
            self.cache.crop(-self.pending)
            self.pending = 0

    def commit(self, keep: torch.Tensor | list[int]) -> None:
        """Request b keeps the first ``keep[b]`` pending columns; the rest become holes (masked)."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)  # [B]
        if keep.numel() != self.batch_size or bool((keep < 0).any()) or bool((keep > self.pending).any()):
            raise ValueError(f"keep must give 0..{self.pending} columns for each of {self.batch_size} rows, got {keep.tolist()}")
        cols = torch.arange(self.pending, device=self.device)  # [pending]
        self.valid = torch.cat([self.valid, cols[None] < keep[:, None]], dim=1)  # [B, S + pending]
        self.lengths = self.lengths + keep
        self.pending = 0
        if self.holes() > self.max_holes:
            self.compact()

    def holes(self) -> int:
        """Columns beyond what the longest request needs (padding that compaction would remove)."""
        if self.batch_size == 0:
            return self.valid.shape[1]
        return self.valid.shape[1] - int(self.lengths.max())

    def compact(self) -> None:
        """Right-align every row's valid columns and drop the columns no row needs.

        A stable sort of ``valid`` puts each row's invalid columns first and its valid ones last,
        both in column order; the last ``max(lengths)`` entries are the gather index. The left
        padding it leaves holds stale but finite KV, which the mask hides.
        """
        if self.pending:
            raise RuntimeError("compact() with pending columns; commit or discard them first")
        B, S = self.valid.shape
        L = int(self.lengths.max()) if B else 0
        if L == S and bool(self.valid.all()):
            return
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, S - L:]  # [B, L]
        for layer in _layers(self.cache):
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, heads, S, D]
                index = order[:, None, :, None].expand(t.shape[0], t.shape[1], L, t.shape[3])
                setattr(layer, name, t.gather(2, index))  # [B, heads, L, D]
        self.valid = torch.arange(L, device=self.device)[None] >= (L - self.lengths)[:, None]  # [B, L]
        self.compactions += 1

    def uncommit_last(self) -> None:
        """Forget every row's last committed position, where right-aligned rows all end (after a
        prefill): the column is cropped, and the next forward recomputes it."""
        if self.pending or not bool(self.valid[:, -1].all()):
            raise RuntimeError("uncommit_last() needs rows that all end in the last column, nothing pending")
        self.cache.crop(-1)
        self.valid = self.valid[:, :-1]
        self.lengths = self.lengths - 1

    # ------------------------------------------------------------------------------ membership
    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (finished requests leave the batch), then drop unneeded columns."""
        if self.pending:
            raise RuntimeError("select() with pending columns")
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if len(rows) == 0:
            self.cache = DynamicCache(config=self.config)
            self.valid = self.valid[:0, :0]
            self.lengths = self.lengths[:0]
            return
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid, self.lengths = self.valid[index], self.lengths[index]
        if self.holes() > self.max_holes:
            self.compact()

    def merge(self, other: BatchKV) -> None:
        """Append the rows of ``other`` (new requests after their prefill); the shorter side is left-padded."""
        if self.pending or other.pending:
            raise RuntimeError("merge() with pending columns")
        if self.batch_size == 0:
            self.cache, self.valid, self.lengths = other.cache, other.valid, other.lengths
            return
        S = max(self.valid.shape[1], other.valid.shape[1])
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if len(mine) != len(theirs):
            raise RuntimeError("cannot merge caches with different layer counts")
        for a, b in zip(mine, theirs):
            for name in ("keys", "values"):
                x, y = _left_pad(getattr(a, name), S), _left_pad(getattr(b, name), S)
                setattr(a, name, torch.cat([x, y], dim=0))  # [B_a + B_b, heads, S, D]
        self.valid = torch.cat([_left_pad_mask(self.valid, S), _left_pad_mask(other.valid, S)], dim=0)
        self.lengths = torch.cat([self.lengths, other.lengths])

    # ------------------------------------------------------------------------------ prefill
    def prefill_inputs(self, prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded ``input_ids [B, P]`` for an empty state and ``token_valid [B, P]`` (None: no
        padding); the next `run` is their prefill, with per-row positions and the padding masked."""
        if self.batch_size or self.pending:
            raise RuntimeError("prefill_inputs() needs an empty state")
        P = max(int(p.numel()) for p in prompts)
        B = len(prompts)
        ids = torch.full((B, P), pad_id, dtype=torch.long, device=self.device)
        valid = torch.zeros(B, P, dtype=torch.bool, device=self.device)
        for b, p in enumerate(prompts):
            n = int(p.numel())
            ids[b, P - n:] = p.reshape(-1).to(self.device)
            valid[b, P - n:] = True
        self.prefill = ((valid.long().cumsum(1) - 1).clamp(min=0), valid.long())  # positions, mask [B, P]
        self.valid = valid
        self.lengths = valid.sum(1)
        return ids, (valid if not bool(valid.all()) else None)


def _left_pad(t: torch.Tensor, S: int) -> torch.Tensor:
    """``t [B, heads, s, D]`` padded with zero columns on the left to S columns."""
    missing = S - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


def _left_pad_mask(valid: torch.Tensor, S: int) -> torch.Tensor:
    missing = S - valid.shape[1]
    return valid if missing == 0 else torch.cat([valid.new_zeros(valid.shape[0], missing), valid], dim=1)
