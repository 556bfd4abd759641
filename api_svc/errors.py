"""OpenAI's error body and the mapping from the scheduler's gRPC status codes to HTTP.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with the right status; `param` names the
request field when the failure is about one.
"""

from __future__ import annotations

import re

import grpc
from fastapi.responses import JSONResponse

RETRY_AFTER_S = 1  # what a 503 tells clients to wait before trying again

# The scheduler names the field at the start of its INVALID_ARGUMENT messages ("sampling.top_p must be ...",
# "prompt is 300 tokens; ...", "chat.messages[0].role ..."), or as "sampling.X" inside a sum of lengths.
_SAMPLING_FIELD = re.compile(r"\bsampling\.(\w+)")
_LEADING_FIELD = re.compile(r"^(prompt|chat\.messages)\b")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist; this server serves `{served}`.", "NotFoundError",
                    "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Missing or wrong API key: send `Authorization: Bearer <key>`.", "AuthenticationError",
                    None, "invalid_api_key")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "ServiceUnavailableError", None, "service_unavailable",
                    {"Retry-After": str(RETRY_AFTER_S)})


def _param_of(message: str, chat: bool) -> str | None:
    m = _SAMPLING_FIELD.search(message)
    if m:
        return m.group(1)
    if "max_tokens (" in message:  # "prompt (N tokens) + max_tokens (M) = ... can never fit the KV pool"
        return "max_tokens"
    m = _LEADING_FIELD.match(message)
    if m:
        return "messages" if chat or m.group(1) == "chat.messages" else "prompt"
    return None


def from_grpc(code: grpc.StatusCode, details: str, chat: bool = False) -> APIError:
    """The HTTP error for a failed Generate (or other) call of the scheduler."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # the scheduler's field paths, spelled as OpenAI's fields
        message = details.replace("sampling.", "").replace("chat.messages", "messages")
        return bad_request(message, _param_of(details, chat))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "queue" in details:  # the waiting queue is full: come back later
            return APIError(429, details, "RateLimitError", None, "rate_limit_exceeded",
                            {"Retry-After": str(RETRY_AFTER_S)})
        # A request that can never fit the KV pool, even alone: retrying will not help.
        return bad_request(details, _param_of(details, chat))
    if code == grpc.StatusCode.NOT_FOUND:  # a LoRA adapter unloaded since the model check
        return APIError(404, details, "NotFoundError", "model", "model_not_found")
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(details or "the scheduler is unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, details, "TimeoutError", None, "queue_timeout")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return APIError(502, f"the scheduler refused this API server's credentials (--scheduler-api-key): {details}",
                        "BadGatewayError", None, "bad_gateway")
    return APIError(502, f"the scheduler failed the request: {code.name}: {details}", "BadGatewayError", None,
                    "bad_gateway")
