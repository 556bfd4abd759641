"""Prometheus metrics of the HTTP layer (GET /metrics): requests by handler and status, time to first byte,
duration. An ASGI middleware, so that streamed responses are timed at their first body chunk."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
KNOWN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version", "/tokenize",
                         "/detokenize", "/metrics"})


class HTTPMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("http_requests_total", "HTTP requests by handler, method and status",
                                ["handler", "method", "status"], registry=r)
        self.ttfb = Histogram("http_time_to_first_byte_seconds", "From the request to the first byte of the body "
                              "(a stream's first chunk)", ["handler"], buckets=_BUCKETS, registry=r)
        self.duration = Histogram("http_request_duration_seconds", "From the request to the end of the response",
                                  ["handler"], buckets=_BUCKETS, registry=r)


class MetricsMiddleware:
    def __init__(self, app, metrics: HTTPMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        handler = path if path in KNOWN_PATHS else "other"  # bounded label values
        start = time.perf_counter()
        state = {"status": 500, "first": True}

        async def timed_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and state["first"]:
                state["first"] = False
                self.metrics.ttfb.labels(handler).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.metrics.requests.labels(handler, scope["method"], str(state["status"])).inc()
            self.metrics.duration.labels(handler).observe(time.perf_counter() - start)
