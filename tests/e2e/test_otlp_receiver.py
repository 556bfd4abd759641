"""Spans from real processes, received over OTLP/gRPC by a trace collector inside the test.

The test runs an `opentelemetry.proto.collector.trace.v1.TraceService` on a free port, starts a real worker (told
by `--otlp-traces-endpoint`) and a real scheduler (told by OTEL_EXPORTER_OTLP_ENDPOINT), streams three concurrent
Generate requests (one carrying a W3C `traceparent`), starts a fourth, long one, stops both processes with SIGTERM
while it runs (--shutdown-timeout 0: it is left for a next scheduler) and checks what arrived.

The scheduler's batch processor waits 60 s between exports (OTEL_BSP_SCHEDULE_DELAY), so every scheduler span
the collector holds was flushed by the SIGTERM shutdown path; the worker's waits 50 ms, so its spans also show
that export works while the process runs.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tspb_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
NUM_BLOCKS = 256
BUDGET = 64
SCHEDULER = "llmserve-scheduler"
WORKER = "llmserve-worker"
LONG_MAX_TOKENS = 400  # prompt + this fits --max-model-len 512
PHASES = {"llmserve.worker.prepare_inputs", "llmserve.worker.forward", "llmserve.worker.sample"}


class Collector(tspb_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps every export request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[tspb.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return tspb.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self.lock:
            reqs = list(self.requests)
        return [Span.of(rs.resource, s) for r in reqs for rs in r.resource_spans for ss in rs.scope_spans
                for s in ss.spans]


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    """One received span, ids as lowercase hex ("" for no parent)."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attrs: dict
    events: list[tuple[str, dict]] = field(default_factory=list)

    @classmethod
    def of(cls, resource, s: trace_pb2.Span) -> Span:
        return cls(service=_attrs(resource.attributes).get("service.name", ""), name=s.name, kind=s.kind,
                   trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                   start=s.start_time_unix_nano, end=s.end_time_unix_nano, attrs=_attrs(s.attributes),
                   events=[(e.name, _attrs(e.attributes)) for e in s.events])


def _generate(address: str, prompt: str, max_tokens: int, metadata=None) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, top_p=0.9, ignore_eos=True))
        return list(pb_grpc.LLMServeStub(ch).Generate(req, timeout=120, metadata=metadata))


def _start_stream(address: str, prompt: str, max_tokens: int) -> dict:
    """Stream one request on a thread; the dict collects its tokens and how the stream ended."""
    out: dict = {"tokens": [], "error": None}

    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            try:
                for msg in pb_grpc.LLMServeStub(ch).Generate(req, timeout=120):
                    out["tokens"].extend(msg.token_ids)
            except grpc.RpcError as e:
                out["error"] = e.code()

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


@pytest.fixture(scope="module")
def run(redis_server):  # noqa: F811
    """One traced run: the collector, both processes, three requests, a graceful stop. Yields what was seen."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    tspb_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # OTEL_SERVICE_NAME empty: each process names itself, whatever the outer environment says.
    base = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false", "OTEL_SERVICE_NAME": ""}
    worker = scheduler = None
    try:
        worker = cluster.start_worker(
            ["--num-gpu-blocks-override", NUM_BLOCKS, "--max-model-len", 512, "--otlp-traces-endpoint", endpoint],
            env={**base, "OTEL_BSP_SCHEDULE_DELAY": "50"})
        scheduler = cluster.start_scheduler(
            redis_server, worker, ["--max-num-batched-tokens", BUDGET, "--no-enable-prefix-caching"],
            env={**base, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "60000"})
        cluster.wait_healthy(scheduler.address, proc=scheduler)

        prompts = [("The quick brown fox " * (2 + i), 4 + i) for i in range(3)]
        results: dict[int, list] = {}

        def one(i: int) -> None:
            md = [("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")] if i == 0 else None
            results[i] = _generate(scheduler.address, *prompts[i], md)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # The worker exports every 50 ms: some of its spans arrive while it runs.
        deadline = time.monotonic() + 10
        while not any(s.service == WORKER for s in collector.spans()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # A request still running at SIGTERM (--shutdown-timeout 0: left in Redis for the next scheduler).
        unfinished = _start_stream(scheduler.address, "Tell me a long story", LONG_MAX_TOKENS)
        deadline = time.monotonic() + 60
        while len(unfinished["tokens"]) < 2 and time.monotonic() < deadline and unfinished["thread"].is_alive():
            time.sleep(0.02)
        before_stop = collector.spans()
        rc_scheduler = cluster.stop(scheduler, timeout=30)
        unfinished["thread"].join(30)
        rc_worker = cluster.stop(worker, timeout=30)
        yield dict(spans=collector.spans(), before_stop=before_stop, prompts=prompts, results=results,
                   unfinished=unfinished, rc_scheduler=rc_scheduler, rc_worker=rc_worker)
    finally:
        for proc in (scheduler, worker):
            if proc is not None:
                cluster.stop(proc)
        server.stop(grace=None)


def test_processes_export_and_flush_on_sigterm(run):
    assert run["rc_scheduler"] == 0 and run["rc_worker"] == 0
    assert len(run["results"]) == 3
    for i, (_, max_tokens) in enumerate(run["prompts"]):
        assert sum(len(m.token_ids) for m in run["results"][i]) == max_tokens
    # Live export from the worker; nothing from the scheduler until its shutdown flush (60 s schedule delay).
    assert any(s.service == WORKER for s in run["before_stop"])
    assert not any(s.service == SCHEDULER for s in run["before_stop"])
    services = {s.service for s in run["spans"]}
    assert services == {SCHEDULER, WORKER}
    # Every span arrived once: the shutdown flush does not resend what the schedule already exported.
    ids = [s.span_id for s in run["spans"]]
    assert len(ids) == len(set(ids))


def test_iteration_and_worker_spans_across_processes(run):
    spans = run["spans"]
    by_id = {s.span_id: s for s in spans}
    iters = [s for s in spans if s.name == "llmserve.iteration"]
    assert iters and all(s.service == SCHEDULER and s.parent_id == "" for s in iters)
    for s in iters:
        a = s.attrs
        for key in ("llmserve.step.id", "llmserve.step.prefill_tokens", "llmserve.step.decode_seqs",
                    "llmserve.step.scheduled_seqs", "llmserve.step.preemptions", "llmserve.num_running",
                    "llmserve.num_waiting", "llmserve.redis.commit_seconds", "llmserve.worker.forward_seconds"):
            assert key in a, key
        assert 0 < a["llmserve.step.tokens"] <= a["llmserve.step.token_budget"] == BUDGET
        assert a["llmserve.kv.free_blocks"] + a["llmserve.kv.used_blocks"] == NUM_BLOCKS
        assert s.start <= s.end
    assert any(s.attrs["llmserve.step.decode_seqs"] > 1 for s in iters)  # the three requests shared steps

    calls = [s for s in spans if s.name == "llmserve.worker/ExecuteStep"]
    assert len(calls) == len(iters)
    servers = [s for s in spans if s.name == "llmserve.worker.v2.Worker/ExecuteStep"]
    server_of = {s.parent_id: s for s in servers if s.parent_id}
    for call in calls:
        it = by_id[call.parent_id]  # the worker call is a child of its iteration, in the scheduler
        assert it.name == "llmserve.iteration" and call.service == SCHEDULER
        assert call.kind == trace_pb2.Span.SPAN_KIND_CLIENT and call.trace_id == it.trace_id
        assert call.attrs["llmserve.step.id"] == it.attrs["llmserve.step.id"]
        assert it.start <= call.start <= call.end <= it.end
        # ... continued in the worker process by a server span, whose children are the three phases.
        assert call.span_id in server_of, f"no worker span continues the worker call of step {it.attrs}"
        srv = server_of[call.span_id]
        assert srv.service == WORKER and srv.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert srv.trace_id == call.trace_id and srv.attrs["llmserve.step.id"] == call.attrs["llmserve.step.id"]
        phases = [s for s in spans if s.parent_id == srv.span_id]
        assert {p.name for p in phases} == PHASES and len(phases) == 3
        for p in phases:
            assert p.service == WORKER and p.trace_id == call.trace_id
            assert p.attrs["llmserve.step.id"] == call.attrs["llmserve.step.id"]
        assert sum(p.end - p.start for p in phases) <= srv.end - srv.start
    # Worker server spans with no scheduler parent: only the untraced fence plan a new leader sends (no phases).
    orphans = [s for s in servers if not s.parent_id]
    assert len(orphans) <= 1 and not any(s.parent_id == o.span_id for o in orphans for s in spans)
    assert len(servers) == len(calls) + len(orphans)


def test_request_spans_and_client_trace(run):
    spans = run["spans"]
    reqs = [s for s in spans if s.attrs.get("gen_ai.operation.name") == "text_completion"
            and s.attrs["gen_ai.request.max_tokens"] != LONG_MAX_TOKENS]
    assert len(reqs) == 3 and all(s.service == SCHEDULER for s in reqs)
    assert sorted(s.attrs["gen_ai.usage.output_tokens"] for s in reqs) == sorted(m for _, m in run["prompts"])
    for s in reqs:
        a = s.attrs
        assert a["gen_ai.request.max_tokens"] == a["gen_ai.usage.output_tokens"]
        assert a["gen_ai.request.model"] and s.name == f"text_completion {a['gen_ai.request.model']}"
        assert a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] < 120
        names = [name for name, _ in s.events]
        assert names.index("scheduled") < names.index("first token")
        scheduled = dict(s.events)["scheduled"]
        assert scheduled["llmserve.step.id"] > 0 and "llmserve.cached_tokens" in scheduled
    # The request sent with a traceparent joined the client's trace, as a child of the client's span.
    first = next(s for s in reqs if s.attrs["gen_ai.usage.output_tokens"] == run["prompts"][0][1])
    assert first.trace_id == TRACE_ID and first.parent_id == PARENT_SPAN_ID
    for s in reqs:
        if s is not first:
            assert s.parent_id == "" and s.trace_id != TRACE_ID
    # Nothing else claims the client's trace: iterations are traces of their own.
    assert [s for s in spans if s.trace_id == TRACE_ID] == [first]


def test_request_running_at_shutdown_still_exported(run):
    """A request the stopping scheduler leaves to the next one: its span ends (and is flushed) at shutdown."""
    got = run["unfinished"]
    assert 2 <= len(got["tokens"]) < LONG_MAX_TOKENS and got["error"] is not None
    spans = [s for s in run["spans"] if s.attrs.get("gen_ai.request.max_tokens") == LONG_MAX_TOKENS]
    assert len(spans) == 1, "the span of the request running at SIGTERM was lost"
    a = spans[0].attrs
    assert a["gen_ai.response.finish_reasons"] == ["unavailable"]
    assert len(got["tokens"]) <= a["gen_ai.usage.output_tokens"] < LONG_MAX_TOKENS
    assert [name for name, _ in spans[0].events][:2] == ["scheduled", "first token"]
