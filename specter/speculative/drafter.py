"""Drafters: what proposes a window's tokens, one public extension point of the speculative loops.

    SharedDrafter    the target's own instance in draft mode (INT4 experts, same non-expert tensors);
                     its draft positions are scratch columns on the target's KV cache, dropped after
                     the window (verification rewrites them)
    SeparateDrafter  a model instance of its own (own weights, own KV cache) that re-reads what the
                     target committed (SpecMoEOff's draft)

Both count their routes into the ELB they are handed. Every method has a single-request form
(``begin``/``begin_window``/``forward``/``end_window``) and a batched form over a `BatchKV`
(``begin_run``/``join``/``keep_rows``/``first_input``/``step``/``end``/``commit``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specter.speculative.batch_state import BatchKV, Request
from specter.speculative.state import SequenceState

if TYPE_CHECKING:
    from specter.moe import MoERuntime
    from specter.predict.elb import ExpertLoadBuffer


def run_model(model: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
              cache) -> torch.Tensor:
    """Logits ``[B, T, V]`` of a batched forward over ``ids [B, T]`` on ``cache``."""
    return model(input_ids=ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                 use_cache=True).logits


class SharedDrafter:
    """The shared-instance INT4 draft: the target model with its MoE runtime in draft mode."""

    def __init__(self, model: torch.nn.Module, moe: MoERuntime):
        self.model, self.moe = model, moe

    # -- single request ---------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor) -> None:
        """A new sequence starts (``prompt_ids [1, P]``)."""

    def begin_window(self, state: SequenceState) -> None:
        """A window starts after the target committed ``state``."""

    def forward(self, ids: torch.Tensor, state: SequenceState, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        """Draft logits ``[T, V]`` of ``ids [1, T]`` (scratch columns on the target's cache)."""
        with self.moe.mode("draft", elb=elb):
            return self.model(input_ids=ids, cache=state.cache, use_cache=True).logits[0]

    def end_window(self, state: SequenceState) -> None:
        state.discard_extension()  # drop the draft scratch

    # -- batched ----------------------------------------------------------------------------------
    def begin_run(self, device: torch.device, max_holes: int) -> None:
        """A fresh batched run."""

    def join(self, fresh: BatchKV, prompts: list[torch.Tensor]) -> None:
        """Prefilled requests joined the batch (the shared draft reads the target's KV)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only ``rows`` stay in the batch."""

    def first_input(self, active: list[Request], last: torch.Tensor) -> torch.Tensor:
        return last  # [B, 1]: the last committed token, the first uncached input

    def step(self, tok: torch.Tensor, kv: BatchKV, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        """Draft logits ``[B, V]`` after feeding ``tok [B, T]`` (scratch columns on the target's cache)."""
        position_ids, mask = kv.forward_inputs(tok.shape[1])
        kv.appended(tok.shape[1])
        with self.moe.mode("draft", elb=elb):
            return run_model(self.model, tok, position_ids, mask, kv.cache)[:, -1]

    def end(self, kv: BatchKV) -> None:
        kv.discard_pending()  # drop the draft scratch of every request

    def commit(self, accepted: list[int]) -> None:
        """Nothing to keep: the shared-instance draft reads the target's committed KV."""


class SeparateDrafter(SharedDrafter):
    """A draft that is its own model instance and keeps its own KV cache.

    Single request: the cache holds draft KV for a prefix of the committed sequence; before each
    window it is cropped to what the target committed (accepted drafts keep their KV) and the
    committed tokens it has not seen yet (the prompt, a bonus-accepted last draft) are fed with the
    window's first draft step.

    Batched: between windows the draft cache holds each request's committed tokens but the last
    two, and the window's first step feeds those two (``[B, 2]``), so every row has the same shape
    whatever it accepted before; after verification a row keeps a+1 of the window's Kb+1 draft
    columns, which restores that invariant. At admission the prompts are prefilled (padding masked)
    and their last position given back. Prompt routes are not counted into the ELB.
    """

    def __init__(self, model: torch.nn.Module, moe: MoERuntime):
        super().__init__(model, moe)
        self.cache = None  # single request: a DynamicCache
        self.kv: BatchKV | None = None  # batched

    # -- single request ---------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.prompt: list[int] = prompt_ids[0].tolist()
        self.cache = DynamicCache(config=self.model.config)
        self.unseen: list[int] = []

    def begin_window(self, state: SequenceState) -> None:
        have = self.cache.get_seq_length()
        if have > state.committed_kv:  # rejected drafts
            self.cache.crop(state.committed_kv - have)
        committed = self.prompt + state.tokens  # the last one is the uncached input
        self.unseen = committed[min(have, state.committed_kv):state.committed_kv]

    def forward(self, ids: torch.Tensor, state: SequenceState, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        if self.unseen:
            ids = torch.cat([torch.tensor([self.unseen], device=ids.device), ids], dim=1)  # [1, n+1]
            self.unseen = []
        with self.moe.mode("draft", elb=elb):
            return self.model(input_ids=ids, cache=self.cache, use_cache=True).logits[0]  # [T, V]

    def end_window(self, state: SequenceState) -> None:
        """The target's cache holds no draft scratch; the draft's own is cropped at the next window."""

    # -- batched ----------------------------------------------------------------------------------
    def begin_run(self, device: torch.device, max_holes: int) -> None:
        self.device, self.max_holes = device, max_holes
        self.kv = BatchKV(self.model.config, device, max_holes)

    def join(self, fresh: BatchKV, prompts: list[torch.Tensor]) -> None:
        draft = BatchKV(self.model.config, self.device, self.max_holes)
        ids, positions, mask = draft.prefill_inputs(prompts, getattr(self.model.config, "pad_token_id", None) or 0)
        with self.moe.mode("draft", elb=None):
            run_model(self.model, ids, positions, mask, draft.cache)
        draft.uncommit_last()  # the first window feeds it again, beside the first uncached token
        self.kv.merge(draft)

    def keep_rows(self, rows: list[int]) -> None:
        self.kv.select(rows)

    def first_input(self, active: list[Request], last: torch.Tensor) -> torch.Tensor:
        before = torch.tensor([(r.prompt + r.tokens)[-2] for r in active], device=last.device)  # [B]
        return torch.cat([before[:, None], last], dim=1)  # [B, 2]

    def step(self, tok: torch.Tensor, kv: BatchKV, elb: ExpertLoadBuffer | None) -> torch.Tensor:
        return super().step(tok, self.kv, elb)  # on its own cache

    def end(self, kv: BatchKV) -> None:
        """The target's cache holds no draft scratch."""

    def commit(self, accepted: list[int]) -> None:
        self.kv.commit([a + 1 for a in accepted])
