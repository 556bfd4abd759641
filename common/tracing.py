"""OpenTelemetry tracing, off unless configured.

Configured by the standard variables (OTEL_TRACES_EXPORTER = otlp | console | none, OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED, ...) or by
`--otlp-traces-endpoint` (OTLP over gRPC). With none of them set tracing is off: no provider is built, `enabled`
stays False, and instrumented code checks that flag before building any span or attribute dict, so a step costs
one attribute load per instrumentation point.

Instrumented code does::

    from common import tracing
    if tracing.enabled:
        span = tracing.tracer.start_span(...)

`install(provider)` sets an already built provider (tests: an in-memory exporter), `disable()` turns it off again.
W3C trace context crosses gRPC hops through `inject` (metadata for an outgoing call) and `extract` (incoming).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("llmserve.tracing")

enabled = False
tracer: Any = None  # an opentelemetry.trace.Tracer while enabled
provider: Any = None  # the TracerProvider set up here (shut down by `shutdown`)

_propagator: Any = None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def exporter_kind(endpoint: str | None = None, env: dict[str, str] | None = None) -> str | None:
    """Which exporter the flags and environment ask for: "otlp", "console" or None (tracing off)."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return None
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    if names:
        if names == ["none"]:
            return None
        for name in names:
            if name not in ("otlp", "console", "none"):
                raise SystemExit(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: only otlp, console and "
                                 "none are supported")
        if "otlp" in names:
            return "otlp"
        return "console" if "console" in names else None
    if endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return None


def setup(service_name: str, endpoint: str | None = None) -> bool:
    """Build the provider the flags and environment ask for; returns whether tracing is on.

    `endpoint`: the `--otlp-traces-endpoint` flag (e.g. http://collector:4317); it wins over the environment's
    endpoint. OTEL_SERVICE_NAME, when set, wins over `service_name`.
    """
    kind = exporter_kind(endpoint)
    if kind is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    tp = TracerProvider(resource=Resource.create(attrs))
    if kind == "console":
        # Synchronous: a debugging exporter whose output should appear while the step runs.
        tp.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise SystemExit("tracing to OTLP needs the package opentelemetry-exporter-otlp-proto-grpc") from None
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint
                                                 else OTLPSpanExporter()))
    install(tp)
    log.info("tracing on: %s exporter%s", kind, f" to {endpoint}" if endpoint else "")
    return True


def install(tp: Any) -> None:
    """Trace through `tp` (a TracerProvider) from now on."""
    global enabled, tracer, provider, _propagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _propagator = TraceContextTextMapPropagator()
    provider = tp
    tracer = tp.get_tracer("llmserve")
    enabled = True


def disable() -> None:
    global enabled, tracer, provider
    enabled = False
    tracer = None
    provider = None


def shutdown() -> None:
    """Flush and stop the provider built by `setup` (exporters send what they hold)."""
    tp = provider
    disable()
    if tp is not None:
        try:
            tp.shutdown()
        except Exception:  # never let tracing break a shutdown
            log.exception("tracing shutdown failed")


def inject(span: Any) -> list[tuple[str, str]]:
    """gRPC metadata carrying `span` as the W3C parent (traceparent, tracestate)."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def extract(metadata) -> Any:
    """The W3C parent context from incoming gRPC metadata (`context.invocation_metadata()`), or None."""
    carrier = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate") and isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    return _propagator.extract(carrier)


def context_with(span: Any) -> Any:
    """A context whose current span is `span` (to parent children on it explicitly)."""
    from opentelemetry import trace

    return trace.set_span_in_context(span)
