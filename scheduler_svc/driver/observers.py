"""Observers of the scheduler loop: Prometheus metrics, OpenTelemetry spans, the JSONL step log, step timings.

The driver calls every observer at the same points with the same plain records, so the loop has no per-concern
branches and an observer that is not configured (tracing off, no step log) is simply not in the list.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass

from common import tracing
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import StepRecord
from scheduler_svc.metrics import Metrics


class Observer:
    """Every hook is optional; the driver calls them on its own thread."""

    def requests_added(self, reqs: list[Request]) -> None:
        """Sequences of one request entered the queue."""

    def step_started(self, record: StepRecord) -> None:
        """The step is scheduled and about to be sent to the worker."""

    def step_committed(self, record: StepRecord) -> None:
        """The step's effects (or, with no scheduled requests, changes made between steps) are in Redis."""

    def step_failed(self, record: StepRecord) -> None:
        """The worker call or the commit failed; the step's effects never reached clients."""

    def serving_stopped(self, reqs: list[Request]) -> None:
        """This process stops serving these unfinished requests (lost lease, shutdown)."""


class MetricsObserver(Observer):
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def requests_added(self, reqs: list[Request]) -> None:
        if reqs:
            self.metrics.request_added(reqs)

    def step_committed(self, record: StepRecord) -> None:
        m, out, outcome = self.metrics, record.output, record.outcome
        m.preempted(len(out.preempted))
        m.prefix_cache(out.prefix_cache_queries, out.prefix_cache_hits)
        for req in outcome.newly_scheduled:
            m.request_scheduled(req, record.now)
        for req in outcome.first_token:
            m.first_token(req, record.now)
        for req, toks in outcome.appended:
            m.tokens_generated(req, len(toks), record.now)
        for req in record.finished:
            m.request_finished(req, time.time())
        if out.scheduled:
            m.step_done(out, record.num_running, record.num_waiting, record.kv_usage)
            m.state_slots(record.state_usage, record.num_state_snapshots, record.state_snapshot_share)
        m.redis_commit(record.commit_seconds)
        if record.worker is not None:
            m.worker_step(record.worker.forward_seconds, record.worker.idle_seconds, record.end - record.start)
            if record.worker.num_constrained:
                m.structured_step(record.worker.num_constrained, record.worker.mask_seconds)
            if record.worker.spec is not None:
                m.spec_decode(record.worker.spec)


class TracingObserver(Observer):
    """A span per request (gen_ai.* attributes, events for scheduling, preemption and the first token) and a span
    per iteration, parent of the worker call's client span (which the worker continues). While tracing is off
    (`tracing.enabled`, checked once per hook) it builds nothing."""

    def __init__(self):
        self.model_name = ""  # set once the worker has described itself
        self.token_budget = 0
        self.spans: dict[str, object] = {}  # request id -> open span

    def requests_added(self, reqs: list[Request]) -> None:
        if not tracing.enabled:
            return
        for req in reqs:
            s = req.sampling
            attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.model_name,
                     "gen_ai.request.max_tokens": s.max_tokens, "llmserve.request_id": req.request_id,
                     "gen_ai.usage.input_tokens": req.num_prompt_tokens, "gen_ai.request.temperature": s.temperature,
                     "gen_ai.request.top_p": s.top_p}
            self.spans[req.request_id] = tracing.tracer.start_span(
                f"text_completion {self.model_name}".strip(), context=req.trace_context,
                start_time=int(req.arrival_time * 1e9), attributes=attrs)

    def step_started(self, record: StepRecord) -> None:
        if not tracing.enabled:
            return
        out = record.output
        record.trace = tracing.tracer.start_span("llmserve.iteration", start_time=record.start_ns, attributes={
            "llmserve.step.id": record.step_id, "llmserve.step.prefill_tokens": out.num_prefill_tokens,
            "llmserve.step.decode_seqs": out.num_decode_seqs, "llmserve.step.scheduled_seqs": len(out.scheduled),
            "llmserve.step.preemptions": len(out.preempted), "llmserve.step.tokens": out.total_tokens,
            "llmserve.step.token_budget": self.token_budget})
        now_ns = time.time_ns()
        for req in out.admitted:
            self._event(req, "scheduled", {"llmserve.step.id": record.step_id,
                                           "llmserve.cached_tokens": req.num_cached_tokens}, now_ns)
        for req in out.preempted:
            self._event(req, "preempted", {"llmserve.step.id": record.step_id}, now_ns)

    def step_committed(self, record: StepRecord) -> None:
        if not self.spans and record.trace is None:
            return
        for req in record.outcome.first_token:
            self._event(req, "first token", None, int(record.now * 1e9))
        now = time.time()
        for req in record.finished:
            self._end(req, now)
        if record.trace is not None:
            record.trace.set_attributes({
                "llmserve.num_running": record.num_running, "llmserve.num_waiting": record.num_waiting,
                "llmserve.kv.free_blocks": record.num_free_blocks, "llmserve.kv.used_blocks": record.num_used_blocks,
                "llmserve.redis.commit_seconds": record.commit_seconds})
            record.trace.end()

    def step_failed(self, record: StepRecord) -> None:
        if record.trace is not None:
            if record.worker_error is not None:
                record.trace.set_attribute("llmserve.worker.error", record.worker_error)
            else:  # e.g. the lease was lost: still export the step's span, marked
                record.trace.set_attribute("llmserve.commit.error", "commit failed")
            record.trace.end()

    def serving_stopped(self, reqs: list[Request]) -> None:
        now = time.time()
        for req in reqs:
            self._end(req, now, "unavailable")

    def _event(self, req: Request, name: str, attrs, ts: int) -> None:
        span = self.spans.get(req.request_id)
        if span is not None:
            span.add_event(name, attrs, ts)

    def _end(self, req: Request, now: float, reason: str | None = None) -> None:
        span = self.spans.pop(req.request_id, None)
        if span is None:
            return
        attrs = {"gen_ai.usage.input_tokens": req.num_prompt_tokens,
                 "gen_ai.usage.output_tokens": len(req.output_ids),
                 "gen_ai.response.finish_reasons": [reason or req.finish_reason or "unknown"],
                 "llmserve.num_preemptions": req.num_preemptions}
        if req.first_token_time is not None:
            attrs["gen_ai.latency.time_to_first_token"] = max(0.0, req.first_token_time - req.arrival_time)
        if req.scheduled_time is not None:
            attrs["gen_ai.latency.time_in_queue"] = max(0.0, req.scheduled_time - req.arrival_time)
        span.set_attributes(attrs)
        span.end(end_time=int(now * 1e9))


class StepLogObserver(Observer):
    """`--step-log PATH`: one JSON line per executed step (benchmarks and tests read the scheduler's decisions)."""

    def __init__(self, path: str, mode: str):
        self.file = open(path, "a", buffering=1)
        self.mode = mode

    def step_committed(self, record: StepRecord) -> None:
        out = record.output
        if not out.scheduled:
            return
        self.file.write(json.dumps({
            "step": record.step_id, "time": record.now, "mode": self.mode, "scheduled": out.num_tokens,
            "admitted": [r.request_id for r in out.admitted], "preempted": [r.request_id for r in out.preempted],
            "finished": [r.request_id for r in out.scheduled if r.finished], "running": record.num_running,
            "waiting": record.num_waiting, "kv_usage": record.kv_usage}) + "\n")

    def close(self) -> None:
        self.file.close()


@dataclass
class StepStats:
    wall: float  # scheduling start to commit end
    worker: float  # as the worker reports it (prepare + forward + sample)
    commit: float  # the Redis commit
    running: int
    tokens: int
    forward: float = 0.0  # the worker's report, in parts: the model forward only
    prepare: float = 0.0  # plan handling and input building
    sample: float = 0.0
    idle: float = 0.0  # no plan to run, before this step


class StepTimes(Observer):
    """Per-step timings of the last 100,000 steps (benchmarks read `stats`)."""

    def __init__(self):
        self.stats: deque[StepStats] = deque(maxlen=100_000)

    def step_committed(self, record: StepRecord) -> None:
        w = record.worker
        if record.output.scheduled and w is not None:
            self.stats.append(StepStats(record.end - record.start, w.seconds, record.commit_seconds,
                                        record.num_running, record.output.total_tokens, w.forward_seconds,
                                        w.prepare_seconds, w.sample_seconds, w.idle_seconds))
