"""Incremental detokenization for streamed output."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Text of a growing token sequence, released piece by piece once its bytes form whole characters.

    The whole sequence is decoded each time (not token by token): tokenizers merge spaces and byte
    pieces across token boundaries, so per-token decoding can differ from decoding the sequence."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        out, self.sent = text[self.sent:], len(text)
        return out
