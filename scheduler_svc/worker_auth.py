"""Adds `authorization: Bearer <--worker-token>` to every scheduler->worker call (Describe, ExecuteStep, ...)."""

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
