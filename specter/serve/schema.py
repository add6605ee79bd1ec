"""The HTTP layer's request bodies (pydantic) and its error: what a client may send, checked before
anything reaches the engine thread (specter/serve/app.py describes the refusals)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specter.assembly.config import SEED_LIMIT


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------------- request bodies
class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of the OpenAI API this server does not use

    model: str
    max_tokens: int | None = None
    # NaN and ±Infinity are refused here (Python's JSON reader accepts them), as run.py refuses them
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # the per-record seeds' range (assembly/config.py)
    stream: bool = False
    n: int = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


def encodable(text: str) -> str:
    """`text` that encodes as UTF-8: a lone surrogate ("\\ud800" in JSON) is refused, not tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {err.start})") from None
    return text


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _encodes(cls, v):
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                encodable(text)
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _encodes(cls, v):
        if isinstance(v, str):
            encodable(v)
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are supported
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or not all(isinstance(t, str) for t in parts):
                raise ApiError(400, "only text content parts are supported", "messages")
            try:
                return encodable("".join(parts))
            except ValueError as err:
                raise ApiError(400, f"messages: {err}", "messages") from None
        return self.content or ""


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
