"""What one HTTP request may contain, in one place. Fixed limits are the scheduler's (common/request_limits.py,
the sampling table's max_items, structured outputs' spec size) and appear in the OpenAPI document, so a client
learns them from the schema; the two an operator tunes are settings of `llmserve api` (APIConfig):
--max-request-body-bytes (413) and --max-prompts-per-request (400).

Everything here runs before the body is turned into gRPC requests, so that no request, however large, holds the
event loop for long: a body is at most --max-request-body-bytes to parse, and the heavy steps after it (building
protobuf messages, tokenizing, decoding, JSON of a whole answer) run in a worker thread (app.py)."""

from __future__ import annotations

from api_svc.errors import APIError, bad_request
from common.request_limits import MAX_N, MAX_STOP_BYTES, MAX_STOP_STRINGS
from common.structured_outputs import MAX_SPEC_BYTES

__all__ = ["MAX_N", "MAX_SPEC_BYTES", "MAX_STOP_BYTES", "MAX_STOP_STRINGS", "BodyLimit", "check_prompts"]

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_PROMPTS = 256
# A refused body up to this many times the limit is read to its end, and dropped, before the 413 is sent: closing a
# socket that still holds unread bytes makes the kernel answer with a reset, which can destroy the 413 on its way.
DRAIN_FACTOR = 4


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                         "RequestTooLargeError", None, "request_too_large")


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is answered 413 before it is parsed: by its Content-Length, or, sent
    without one (chunked), counted as it arrives and held until it is whole (at most `max_bytes`). The rest of a
    refused body is read and dropped (up to DRAIN_FACTOR times the limit), so the client gets the 413 whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(scope, receive, send, more_body=True,
                                          drain=int(length) <= DRAIN_FACTOR * self.max_bytes)
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                chunks.clear()
                return await self._refuse(scope, receive, send, more_body=message.get("more_body", False), drain=True)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()  # after the body: the disconnect, for handlers that wait for it
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, *, more_body: bool, drain: bool) -> None:
        """413 naming the limit; the rest of the body (`more_body`) read and dropped first where `drain` says it is
        small enough, so that the client sees the answer rather than a reset."""
        budget = DRAIN_FACTOR * self.max_bytes
        while more_body and drain and budget > 0:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            budget -= len(message.get("body", b""))
            more_body = message.get("more_body", False)
        response = BodyTooLarge(self.max_bytes).response()
        if more_body:
            response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def check_prompts(prompt: object, max_prompts: int, max_model_len: int) -> None:
    """A completions `prompt` (a string, strings, token ids or lists of token ids): at most `max_prompts` of them,
    and token-id prompts shorter than the model's context (text prompts are measured by the scheduler, which
    tokenizes them)."""
    if isinstance(prompt, str):
        return
    if prompt and all(isinstance(x, int) for x in prompt):
        token_prompts: list = [prompt]
    else:
        if len(prompt) > max_prompts:
            raise bad_request(f"prompt has {len(prompt)} prompts, the limit is {max_prompts} "
                              "(--max-prompts-per-request)", "prompt")
        token_prompts = [p for p in prompt if isinstance(p, list)]
    for k, ids in enumerate(token_prompts):
        if len(ids) >= max_model_len:
            where = "prompt" if len(token_prompts) == 1 else f"prompt[{k}]"
            raise bad_request(f"{where} has {len(ids)} tokens, but this model's maximum context length is "
                              f"{max_model_len} tokens (max_model_len): a prompt must be shorter than that",
                              "prompt")
