"""The OpenAPI document as the routes really answer: FastAPI derives the request bodies, this module
states the responses. Every refusal carries the one error body (schema.py `error_body`), FastAPI's 422
is never sent (the app answers invalid bodies with a 400), and `/metrics` is Prometheus text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_REF = {"$ref": "#/components/schemas/Error"}
OBJECT = {"type": "object"}

# why each status can answer (docs/serving.md, docs/input_safety.md)
REFUSALS = {
    "400": "a malformed or refused request: invalid JSON, a field out of range, an unsupported field, a prompt "
           "beyond the context (the error's param and code say which)",
    "404": "another model's name, or an unknown path",
    "405": "a method the path does not take (the Allow header lists those it takes)",
    "408": "headers or body not sent within the server's timeouts",
    "413": "a body over 4 MiB",
    "500": "an unexpected failure, in one line",
    "503": "the queue is full (Retry-After), the engine has stopped, the server is shutting down or at its "
           "connection cap",
}
BODY_ROUTES = {"/v1/completions": "a completion", "/v1/chat/completions": "a chat completion"}


def _error(why: str) -> dict[str, Any]:
    return {"description": why, "content": {"application/json": {"schema": ERROR_REF}}}


def _responses(path: str) -> dict[str, Any]:
    if path in BODY_ROUTES:
        ok = {"description": f"{BODY_ROUTES[path]} (JSON), or its server-sent events when stream is true",
              "content": {"application/json": {"schema": OBJECT}, "text/event-stream": {"schema": {"type": "string"}}}}
        codes = ("400", "404", "405", "408", "413", "500", "503")
    elif path == "/metrics":
        ok = {"description": "Prometheus text exposition",
              "content": {"text/plain": {"schema": {"type": "string"}}}}
        codes = ("404", "405", "408", "500", "503")
    else:
        ok = {"description": "JSON", "content": {"application/json": {"schema": OBJECT}}}
        codes = ("404", "405", "408", "500", "503")
    return {"200": ok, **{c: _error(REFUSALS[c]) for c in codes}}


def truthful_openapi(app: FastAPI) -> dict[str, Any]:
    """app.openapi(): FastAPI's document with the responses above in place of its 200 / 422."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, methods in doc.get("paths", {}).items():
            for operation in methods.values():
                operation["responses"] = _responses(path)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        schemas["Error"] = ERROR_SCHEMA
        app.openapi_schema = doc
    return app.openapi_schema
