"""Prometheus metrics of the HTTP layer (GET /metrics): requests by handler and status, time to first byte,
duration. An ASGI middleware, so that streamed responses are timed at their first body chunk. The page also carries
the scheduler's `vllm:*` series, read from its metrics endpoint at each scrape (`scheduler_page`)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.scheduler_up = Gauge("llmserve:scheduler_metrics_up", "1 when this page carries the scheduler's "
                                  "series (read at this scrape), 0 when they could not be read", registry=r)


SCRAPE_TIMEOUT_S = 2.0


def _read(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 (an operator-given URL)
        return resp.read()


async def scheduler_page(metrics: HTTPMetrics, url: str | None) -> bytes:
    """The API's own series, then the scheduler's as it serves them. A scheduler that cannot be read leaves its
    series out, sets `llmserve:scheduler_metrics_up` 0 and says why in a comment line: the page never fails."""
    note = b""
    if url is None:
        metrics.scheduler_up.set(0)
        note = b"# scheduler metrics: not configured (--scheduler-metrics-url)\n"
        return generate_latest(metrics.registry) + note
    try:
        theirs = await asyncio.to_thread(_read, url)
    except (OSError, ValueError) as e:  # refused, timed out, HTTP error, bad URL
        metrics.scheduler_up.set(0)
        reason = str(e).replace("\n", " ")[:200]
        return generate_latest(metrics.registry) + f"# scheduler metrics unavailable from {url}: {reason}\n".encode()
    metrics.scheduler_up.set(1)
    return generate_latest(metrics.registry) + theirs


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
