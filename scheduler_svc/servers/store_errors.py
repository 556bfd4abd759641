"""Redis failures on a request path leave the public servers as UNAVAILABLE, the status clients retry.

A handler that reads the ledger (a re-attach looking a request up, a LoRA adapter's registry entry) can meet Redis
in the middle of a fail-over: the primary closed the connection, the Sentinels name no primary yet, a paused or
stopped node times out, a demoted one answers READONLY. Left alone, grpc turns such an exception into UNKNOWN, which
no client retries, and a stream that would have resumed a second later is lost. Every public handler goes through
`retryable_store_errors`, the one place where these failures are mapped; anything else still escapes as the bug
it is.
"""

from __future__ import annotations

import functools
import inspect

import grpc

from scheduler_svc.driver.worker_client import WorkerFenced
from scheduler_svc.ledger.redis_ha import redis_unavailable
from scheduler_svc.ledger.store import LeaseLost


def store_unavailable(e: BaseException) -> bool:
    """Whether `e` means the ledger cannot be used right now (Redis unreachable, failing over, loading, read-only;
    this scheduler fenced by a newer leader) rather than a fault in the request or the code."""
    # ConnectionError covers MasterNotFoundError (redis.sentinel) and BusyLoadingError; redis_unavailable adds
    # TimeoutError, ReadOnlyError, the durability wait and the replies of a primary that refuses writes.
    return redis_unavailable(e) or isinstance(e, (LeaseLost, WorkerFenced))


def unavailable_message(e: BaseException) -> str:
    return (f"the scheduler cannot use its Redis ledger right now ({type(e).__name__}: {e}); it stands by until "
            "Redis (or the primary the Sentinels promote) answers again: retry shortly, a re-attach by request_id "
            "resumes the stream")


def retryable_store_errors(method):
    """Wrap a grpc.aio handler (a coroutine or an async generator taking (self, request, context)) so that a store
    failure ends the call with UNAVAILABLE and a message naming it."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for msg in method(self, request, context):
                    yield msg
            except Exception as e:
                if not store_unavailable(e):
                    raise
                await context.abort(grpc.StatusCode.UNAVAILABLE, unavailable_message(e))
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as e:
            if not store_unavailable(e):
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, unavailable_message(e))
    return unary
