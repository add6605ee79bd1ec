"""Drafters: what proposes a window's tokens, one public extension point of the window loop.

    SharedDrafter    the target's own instance in draft mode (INT4 experts, same non-expert tensors);
                     its draft positions are scratch columns on the target's KV rows, dropped after
                     the window (verification rewrites them)
    SeparateDrafter  a model instance of its own (own weights, own KV rows) that re-reads what the
                     target committed (SpecMoEOff's draft)

Both count their routes into the ELB they are handed, and both speak one protocol over the
loop's rows (a `BatchKV`, or at B = 1 the decode path's `SequenceKV`):
``begin_run`` / ``join`` / ``keep_rows`` / ``first_input`` / ``step`` / ``end`` / ``commit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specter.speculative.batch_state import BatchKV, Request

if TYPE_CHECKING:
    from specter.moe import MoERuntime
    from specter.predict.elb import ExpertLoadBuffer


class SharedDrafter:
    """The shared-instance INT4 draft: the target's model, its MoE runtime in draft mode, on the target's rows."""

    def __init__(self, moe: MoERuntime):
        self.moe = moe

    def begin_run(self, device: torch.device, max_holes: int) -> None:
        """A fresh run."""

    def join(self, fresh, prompts: list[torch.Tensor]) -> None:
        """Prefilled requests joined the batch (the shared draft reads the target's KV)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only ``rows`` stay in the batch."""

    def first_input(self, active: list[Request], last: torch.Tensor) -> torch.Tensor:
        return last  # [B, 1]: the last committed token, the first uncached input

    def step(self, tok: torch.Tensor, rows, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        """Draft logits ``[B, V]`` after feeding ``tok [B, T]`` (scratch columns on the target's rows)."""
        with self.moe.mode("draft", elb=elb):
            return rows.run(tok)[:, -1]

    def end(self, rows) -> None:
        rows.discard_pending()  # drop the draft scratch of every request

    def commit(self, accepted: list[int]) -> None:
        """Nothing to keep: the shared-instance draft reads the target's committed KV."""


class SeparateDrafter(SharedDrafter):
    """A draft that is its own model instance and keeps its own `BatchKV` (any B, B = 1 included).

    Between windows the draft cache holds each request's committed tokens but the last two, and
    the window's first step feeds those two (``[B, 2]``), so every row has the same shape whatever
    it accepted before; after verification a row keeps a+1 of the window's Kb+1 draft columns,
    which restores that invariant. At admission the prompts are prefilled (padding masked) and
    their last position given back. Prompt routes are not counted into the ELB.
    """

    def __init__(self, model: torch.nn.Module, moe: MoERuntime):
        super().__init__(moe)
        self.model = model
        self.kv: BatchKV | None = None

    def begin_run(self, device: torch.device, max_holes: int) -> None:
        self.device, self.max_holes = device, max_holes
        self.kv = BatchKV(self.model, device, max_holes)

    def join(self, fresh, prompts: list[torch.Tensor]) -> None:
        draft = BatchKV(self.model, self.device, self.max_holes)
        ids, _ = draft.prefill_inputs(prompts, getattr(self.model.config, "pad_token_id", None) or 0)
        with self.moe.mode("draft", elb=None):
            draft.run(ids)
        draft.uncommit_last()  # the first window feeds it again, beside the first uncached token
        self.kv.merge(draft)

    def keep_rows(self, rows: list[int]) -> None:
        self.kv.select(rows)

    def first_input(self, active: list[Request], last: torch.Tensor) -> torch.Tensor:
        before = torch.tensor([(r.prompt + r.tokens)[-2] for r in active], device=last.device)  # [B]
        return torch.cat([before[:, None], last], dim=1)  # [B, 2]

    def step(self, tok: torch.Tensor, rows, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        return super().step(tok, self.kv, elb)  # on its own rows

    def end(self, rows) -> None:
        """The target's rows hold no draft scratch."""

    def commit(self, accepted: list[int]) -> None:
        self.kv.commit([a + 1 for a in accepted])
