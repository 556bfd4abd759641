"""The Embed RPC (llmserve.v1 and vLLM's engine protocol): one prompt's pooled final hidden state.

An embedding is a request like any other on the scheduler's steps: admitted with max_tokens 1 and the sampling
record's `embed` flag, it is prefilled (in chunks where the budget says so) next to generation, the worker pools
its hidden states (worker_svc/sampling/pooling.py) in the step that completes the prompt and returns the vector with
that step's one sampled token, and the request finishes there: its blocks are freed like any finished request's. It
never reads the prefix cache (every position is computed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from protos import llmserve_pb2 as pb
from scheduler_svc.core.scheduler import FINISH_REJECTED, FINISH_TIMEOUT
from scheduler_svc.driver.outbox import UNAVAILABLE

if TYPE_CHECKING:
    from scheduler_svc.driver.driver import Driver
    from scheduler_svc.driver.outbox import Published

ID_PREFIX = "embd-"  # vLLM's prefix for embedding request ids: they never meet a generation's id


def generate_request(req: pb.EmbedRequest, request_id: str) -> pb.GenerateRequest:
    """The request admission checks and queues for `req`: its prompt, one greedy token."""
    out = pb.GenerateRequest(request_id=ID_PREFIX + request_id, priority=req.priority, cache_salt=req.cache_salt)
    kind = req.WhichOneof("prompt")
    if kind == "text":
        out.text = req.text
    elif kind == "token_ids":
        out.token_ids.ids.extend(req.token_ids.ids)
    out.sampling.max_tokens = 1
    out.sampling.temperature = 0.0
    out.sampling.ignore_eos = True
    return out


async def until_finished(driver: Driver, pub: Published) -> tuple[str, list[float] | None]:
    """Until the request finishes: its finish reason and vector (None unless it was computed). A client that
    leaves aborts the request."""
    outbox, rid = driver.outbox, pub.request.request_id
    watch = outbox.watch([rid])
    finish = None
    try:
        while True:
            with driver.lock:
                finish, vector = pub.finish_reason, pub.embedding
            if finish is not None:
                return finish, vector
            await watch.wait()
    finally:
        outbox.unwatch(watch)
        if finish is None:
            driver.abort(rid)


def failure_status(pub: Published, finish: str) -> tuple[grpc.StatusCode, str]:
    """The status that ends an Embed call whose request finished without a vector."""
    code = {FINISH_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED, FINISH_REJECTED: grpc.StatusCode.INVALID_ARGUMENT,
            UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}.get(finish, grpc.StatusCode.ABORTED)
    return code, (f"embedding request {pub.request.request_id} ended without a vector ({finish}"
                  f"{': ' + pub.error if pub.error else ''})")


async def wait(driver: Driver, pub: Published, context) -> pb.EmbedResponse:
    """Until the request finishes; its vector, or the call ends with the status its finish means."""
    finish, vector = await until_finished(driver, pub)
    if vector is None:
        await context.abort(*failure_status(pub, finish))
    return pb.EmbedResponse(embedding=vector, prompt_tokens=pub.request.num_prompt_tokens)
