"""POST /v1/embeddings (OpenAI's shape, vLLM's behaviour): one Embed call to the scheduler per input, all at once.

The scheduler runs each input as a prefill-only request on its ordinary steps (scheduler_svc/driver/embed.py); the
worker pools the final hidden state as its --pooler-config says. `encoding_format` base64 is the float32 vector's
little-endian bytes (what the openai SDK asks for by default and decodes).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Annotated, Literal

import grpc
import numpy as np
from pydantic import Field

from api_svc.bridge import Bridge
from api_svc.errors import bad_request, from_grpc
from api_svc.protocol import INT32_MAX, TokenId, _Body
from protos import llmserve_pb2 as pb

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(_Body):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] = 0


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    x = body.input
    if isinstance(x, str):
        items: list[str | list[int]] = [x]
    elif x and all(isinstance(t, int) for t in x):
        items = [list(x)]
    else:
        items = list(x)
    if not items:
        raise bad_request("input is empty: give a string, a list of strings, token ids or lists of token ids",
                          "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input has {len(items)} items, the limit is {MAX_INPUTS}", "input")
    return items


def _request(item: str | list[int], request_id: str, priority: int) -> pb.EmbedRequest:
    req = pb.EmbedRequest(request_id=request_id, priority=priority)
    if isinstance(item, str):
        req.text = item
    else:
        req.token_ids.ids.extend(item)
    return req


def _encode(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return list(vector)


async def embeddings(body: EmbeddingRequest, bridge: Bridge, model_name: str, request_id: str) -> dict:
    if body.dimensions is not None:
        raise bad_request("dimensions is not supported: the embedding has the model's hidden size", "dimensions")
    items = _inputs(body)
    client = bridge.client
    # common.client sends an accepted input again after a lost lease or fail-over, so that is no 503 either.
    calls = [asyncio.ensure_future(client.embed(_request(item, f"{request_id}-{i}", body.priority)))
             for i, item in enumerate(items)]
    try:
        replies = await asyncio.gather(*calls)
    except grpc.aio.AioRpcError as e:
        for call in calls:  # the others are cancelled, which aborts their requests in the scheduler
            call.cancel()
        err = from_grpc(e.code(), e.details() or "")
        if err.param == "prompt":  # the scheduler's name for what this API calls input
            err.param, err.message = "input", err.message.replace("prompt", "input", 1)
        raise err from None
    finally:
        for call in calls:
            call.cancel()
    tokens = sum(r.prompt_tokens for r in replies)
    return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(r.embedding, body.encoding_format)}
                     for i, r in enumerate(replies)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
