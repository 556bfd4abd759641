"""Bearer-token checks on gRPC: the worker token on scheduler->worker calls (both ends) and the public API key."""

from __future__ import annotations

import collections

import grpc


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class WorkerTokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation, details, request):
        metadata = [*(details.metadata or ()), self.header]
        return continuation(_Details(details.method, details.timeout, metadata, details.credentials,
                                     getattr(details, "wait_for_ready", None),
                                     getattr(details, "compression", None)), request)


def with_worker_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    return grpc.intercept_channel(channel, WorkerTokenClientInterceptor(token)) if token else channel


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Every call except health checks needs `authorization: Bearer <token>`; others end UNAUTHENTICATED with
    `message`. Streaming methods (`stream_methods`, by name suffix) get a streaming handler to fail with."""

    def __init__(self, token: str, message: str, stream_methods: tuple[str, ...] = ()):
        self.expected = f"Bearer {token}"
        self.stream_methods = stream_methods

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        self.deny = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        if dict(details.invocation_metadata).get("authorization") == self.expected:
            return continuation(details)
        return self.deny_stream if details.method.endswith(self.stream_methods) else self.deny


class AsyncBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`BearerTokenInterceptor` for a grpc.aio server (the scheduler's public API): same rule, same answer."""

    def __init__(self, token: str, message: str, stream_methods: tuple[str, ...] = ()):
        self.expected = f"Bearer {token}"
        self.stream_methods = stream_methods

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        self.deny = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if dict(details.invocation_metadata or ()).get("authorization") == self.expected:
            return await continuation(details)
        return self.deny_stream if details.method.endswith(self.stream_methods) else self.deny


def api_key_interceptor(api_key: str) -> AsyncBearerTokenInterceptor:
    """The scheduler's public API with --api-key."""
    return AsyncBearerTokenInterceptor(api_key, "missing or wrong API key: send metadata "
                                       "'authorization: Bearer <key>'", stream_methods=("/Generate",))


def worker_token_interceptor(token: str) -> BearerTokenInterceptor:
    """The worker with --worker-token (the scheduler sends it on every call)."""
    return BearerTokenInterceptor(token, "missing or wrong worker token: the scheduler must be started with the "
                                  "same --worker-token as this worker")
