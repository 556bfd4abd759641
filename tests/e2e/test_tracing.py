"""OpenTelemetry tracing during a real multi-request run.

An in-process scheduler (Engine + gRPC server, as experiments/scheduler_overhead.py builds it) traces into an in-memory
exporter; the worker is a real process started with OTEL_TRACES_EXPORTER=console, whose spans are parsed from its
output to check that they continue the scheduler's trace across the process boundary (W3C context in gRPC metadata).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import tracing
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def test_exporter_selection(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    assert tracing.exporter_kind(None, {}) is None
    assert tracing.exporter_kind("http://c:4317", {}) == "otlp"
    assert tracing.exporter_kind(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "otlp"
    assert tracing.exporter_kind(None, {"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert tracing.exporter_kind("http://c:4317", {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.exporter_kind("http://c:4317", {"OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(SystemExit, match="zipkin"):
        tracing.exporter_kind(None, {"OTEL_TRACES_EXPORTER": "zipkin"})
    assert tracing.setup("x") is False and not tracing.enabled


def _console_spans(text: str) -> list[dict]:
    """The JSON spans ConsoleSpanExporter printed (one indented object each, starting on a line of its own)."""
    dec = json.JSONDecoder()
    spans, i = [], 0
    while (i := text.find("\n{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i + 1)
        except json.JSONDecodeError:
            i += 2
            continue
        if isinstance(obj, dict) and "context" in obj:
            spans.append(obj)
        i = end
    return spans


@pytest.fixture(scope="module")
def traced_stack(redis_server, tmp_path_factory):  # noqa: F811
    from llmserve.cli import build_parser
    from scheduler_svc.servers.process import build_driver, build_server, config_from_args

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_TRACES_EXPORTER", "console")  # for the worker process only: this process uses `install`
    mp.setenv("OTEL_SERVICE_NAME", "test-worker")
    try:
        worker = cluster.start_worker(["--num-gpu-blocks-override", 256, "--max-model-len", 512])
    finally:
        mp.undo()
    args = build_parser().parse_args(["scheduler", "--redis-url", redis_server, "--worker-address", worker.address,
                                      "--namespace", cluster.new_namespace("trace"), "--host", "127.0.0.1",
                                      "--port", "0", "--max-num-batched-tokens", "64",
                                      # every prompt token is computed, so prefill spans add up to the inputs
                                      "--no-enable-prefix-caching"])
    cfg = config_from_args(args)
    tracing.install(provider)
    driver, _ = build_driver(cfg)
    server, port, _ = build_server(driver, "127.0.0.1:0")
    server.start()
    driver.start()
    try:
        assert driver.ready.wait(180), "the scheduler did not take the pool"
        yield argparse.Namespace(driver=driver, address=f"127.0.0.1:{port}", exporter=exporter, worker=worker)
    finally:
        driver.stop()
        server.stop(grace=1)
        tracing.disable()
        cluster.stop(worker)


def _generate(address: str, prompt: str, max_tokens: int, metadata=None) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, top_p=0.9, ignore_eos=True))
        return list(pb_grpc.LLMServeStub(ch).Generate(req, timeout=120, metadata=metadata))


def test_spans_of_a_multi_request_run(traced_stack):
    st = traced_stack
    st.exporter.clear()
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    prompts = [("Once upon a time " * (3 + i), 6 + i) for i in range(4)]
    results: dict[int, list] = {}

    def one(i: int) -> None:
        md = [("traceparent", traceparent)] if i == 0 else None
        results[i] = _generate(st.address, prompts[i][0], prompts[i][1], md)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    sent = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    window = time.time() - sent  # every request arrived and streamed its first token inside it
    assert len(results) == len(prompts)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = st.exporter.get_finished_spans()
        if sum(1 for s in spans if s.attributes.get("gen_ai.operation.name")) >= len(prompts):
            break
        time.sleep(0.05)
    spans = st.exporter.get_finished_spans()

    # Request spans with gen_ai.* attributes.
    reqs = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "text_completion"]
    assert len(reqs) == len(prompts)
    by_tokens = {s.attributes["gen_ai.usage.output_tokens"]: s for s in reqs}
    assert sorted(by_tokens) == sorted(m for _, m in prompts)
    for s in reqs:
        a = s.attributes
        assert a["gen_ai.request.max_tokens"] == a["gen_ai.usage.output_tokens"]
        assert a["gen_ai.request.model"] == st.driver.worker_info.model.name
        assert a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.usage.input_tokens"] > 0
        assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= window
        names = [e.name for e in s.events]
        assert names.index("scheduled") < names.index("first token")
    # The first request joined the caller's trace.
    first = next(s for s in reqs if s.attributes["gen_ai.usage.output_tokens"] == prompts[0][1])
    assert format(first.context.trace_id, "032x") == TRACE_ID
    assert format(first.parent.span_id, "016x") == PARENT_SPAN_ID
    others = [s for s in reqs if s is not first]
    assert all(s.parent is None and format(s.context.trace_id, "032x") != TRACE_ID for s in others)

    # Iteration spans with their attributes; one worker-call child each.
    iters = [s for s in spans if s.name == "llmserve.iteration"]
    assert iters
    for s in iters:
        a = s.attributes
        for key in ("llmserve.step.id", "llmserve.step.prefill_tokens", "llmserve.step.decode_seqs",
                    "llmserve.num_running", "llmserve.num_waiting", "llmserve.kv.free_blocks",
                    "llmserve.kv.used_blocks", "llmserve.step.preemptions", "llmserve.step.tokens",
                    "llmserve.redis.commit_seconds"):
            assert key in a, key
        assert 0 < a["llmserve.step.tokens"] <= a["llmserve.step.token_budget"] == 64
        assert a["llmserve.kv.free_blocks"] + a["llmserve.kv.used_blocks"] == 256
    assert sum(s.attributes["llmserve.step.prefill_tokens"] for s in iters) >= sum(
        s.attributes["gen_ai.usage.input_tokens"] for s in reqs)
    assert any(s.attributes["llmserve.step.decode_seqs"] > 1 for s in iters)  # a batch of several requests
    calls = {s.parent.span_id: s for s in spans if s.name == "llmserve.worker/ExecuteStep"}
    for s in iters:
        call = calls[s.context.span_id]
        assert call.attributes["llmserve.step.id"] == s.attributes["llmserve.step.id"]
        assert s.start_time <= call.start_time <= call.end_time <= s.end_time

    # Across the process boundary: the worker's spans continue the worker-call spans.
    call_ids = {format(s.context.span_id, "#018x"): s for s in calls.values()}
    deadline = time.monotonic() + 10
    while True:
        wspans = _console_spans(st.worker.log_text())
        servers = [w for w in wspans if w["name"] == "llmserve.worker.v2.Worker/ExecuteStep"
                   and w["parent_id"] in call_ids]
        if len(servers) >= len(call_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(servers) == len(call_ids), (len(servers), len(call_ids))
    for w in servers:
        call = call_ids[w["parent_id"]]
        assert w["context"]["trace_id"] == format(call.context.trace_id, "#034x")
        assert w["resource"]["attributes"]["service.name"] == "test-worker"
        children = {c["name"] for c in wspans if c["parent_id"] == w["context"]["span_id"]}
        assert children == {"llmserve.worker.prepare_inputs", "llmserve.worker.forward", "llmserve.worker.sample"}


def test_tracing_off_builds_nothing(traced_stack, monkeypatch):
    """With tracing off the engine takes the untraced path: no spans, no attribute dicts."""
    st = traced_stack
    st.exporter.clear()
    monkeypatch.setattr(tracing, "enabled", False)
    out = _generate(st.address, "Hello there", 4, [("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")])
    assert sum(len(m.token_ids) for m in out) == 4
    assert st.exporter.get_finished_spans() == ()
