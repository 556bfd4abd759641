"""The OpenAPI document says what the server does: every route's 200 body (JSON, server-sent events when
`stream` is true, Prometheus text for /metrics), and its errors as OpenAI's error body with the statuses the
server answers (400 for a body it refuses, never FastAPI's 422). These models only describe responses; the
server builds them in responses.py."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(_Doc):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(_Doc):
    role: str
    content: str | None


class ChatChoice(_Doc):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(_Doc):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Model(_Doc):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: str
    data: list[Model]


class Tokens(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]


class Text(_Doc):
    prompt: str


class Version(_Doc):
    version: str


class EmbeddingData(_Doc):
    object: str
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64"


class EmbeddingUsage(_Doc):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Doc):
    object: str
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ResponseObject(_Doc):
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]


class ResponseDeleted(_Doc):
    id: str
    object: str
    deleted: bool


# With `stream: true`. OpenAPI 3.1 reads an event stream's schema as the schema of each event.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "description": "one server-sent event: a chunk, an error, or [DONE]",
    "properties": {"data": {"type": "string", "description": "a chunk (or an error body) as JSON, or `[DONE]` last"}}}}}
_ERRORS = {400: "the body or a field is invalid (the message names the field and the limit)",
           401: "missing or wrong API key", 404: "the model is not the one served",
           413: "the body is larger than --max-request-body-bytes", 429: "the scheduler's queue is full",
           500: "an unexpected server error", 502: "the scheduler failed the request",
           503: "the scheduler is unavailable", 504: "the request waited longer than --queue-timeout"}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


def json_route(model: type[BaseModel], *errors: int, stream: bool = False) -> dict[str, Any]:
    """`responses=` of a route whose 200 is `model` (or server-sent events when streamed)."""
    ok: dict[str, Any] = {"model": model, "description": "the answer"}
    if stream:
        ok["content"] = _SSE
    return {200: ok, **_errors(*errors)}


GENERATE = (400, 401, 404, 413, 429, 500, 502, 503, 504)  # completions and chat completions
BODY = (400, 401, 404, 413, 500, 503)  # tokenize, detokenize
STORED = (400, 401, 404, 500, 503)  # a stored response by id (400: the API keeps no responses)
PLAIN = {200: {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}
METRICS = {200: {"description": "Prometheus text exposition format",
                 "content": {"text/plain": {"schema": {"type": "string"}}}}}
HEALTH = {**PLAIN, **_errors(503)}
LORA = {**PLAIN, **_errors(400, 401, 404, 413, 500, 503)}  # 404: unknown adapter, or runtime updating is off


def install(app: FastAPI) -> None:
    """Replace FastAPI's 422 (never answered: app.py turns validation errors into 400) in the document."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in spec["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = document
