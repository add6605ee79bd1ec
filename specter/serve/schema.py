"""The HTTP layer's request bodies (pydantic) and its error: what a client may send, checked before
anything reaches the engine thread (specter/serve/app.py describes the refusals)."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

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
# ---------------------------------------------------------------------------------- the OpenAI fields
# One rule for every field of the OpenAI request types (tests/test_serve_fields.py holds the table to the
# openai client's own): a field the server honours is declared on the bodies below; a field that only labels
# a request (LABELS) is accepted and ignored, as it changes no output; any other field of the endpoint is a
# 400 `unsupported_field` naming it unless its value asks for nothing (null, or a value of NEUTRAL: the
# OpenAI default); a field the endpoint does not have is a 400 `unknown_field`.
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"})
CHAT_FIELDS = frozenset({
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"})
EXTENSIONS = frozenset({"ignore_eos", "return_token_ids"})  # this server's own (docs/serving.md), as vLLM's
LABELS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
                    "prompt_cache_retention", "safety_identifier"})
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "frequency_penalty": (0,), "presence_penalty": (0,),
    "logit_bias": ({},), "logprobs": (False,), "top_logprobs": (0,), "suffix": ("",), "stop": ([], ""),
    "stream_options": ({}, {"include_usage": False}), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "function_call": ("none",), "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
    "modalities": (["text"],)}


def _same(value: Any, neutral: Any) -> bool:
    """`value == neutral`, without Python's True == 1 (n=true is not n=1)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def unhonoured(body: SamplingBody) -> ApiError | None:
    """The 400 that refuses the first field of `body` the server would not honour, else None."""
    known = body.OPENAI_FIELDS
    for name, value in (body.model_extra or {}).items():
        if name not in known:
            return ApiError(400, f"{name!r} is not a field of this endpoint (docs/serving.md lists the fields)",
                            name, "unknown_field")
        if name in LABELS or value is None or any(_same(value, v) for v in NEUTRAL.get(name, ())):
            continue
        accepted = ", ".join(["null", *(json.dumps(v) for v in NEUTRAL.get(name, ()))])
        return ApiError(400, f"{name}={json.dumps(value)[:60]} is not supported by this server (it accepts "
                             f"{accepted} only); "
                             "docs/serving.md lists the fields it honours", name, "unsupported_field")
    return None


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # the other OpenAI fields: `unhonoured` decides each
    OPENAI_FIELDS: ClassVar[frozenset[str]] = COMPLETION_FIELDS | EXTENSIONS

    model: str
    max_tokens: int | None = None
    # NaN and ±Infinity are refused here (Python's JSON reader accepts them), as run.py refuses them
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # the per-record seeds' range (assembly/config.py)
    stream: bool = False
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
    OPENAI_FIELDS: ClassVar[frozenset[str]] = CHAT_FIELDS | EXTENSIONS

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
