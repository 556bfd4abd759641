"""The scheduler's vLLM series from real Request records, and the API's /metrics page with and without the
scheduler's endpoint (a real HTTP server of the scheduler's registry)."""

import asyncio

from prometheus_client import generate_latest

from api_svc.metrics import HTTPMetrics, scheduler_page
from common.sampling_fields import SamplingParams
from scheduler_svc.core.request import FINISH_LENGTH, Request
from scheduler_svc.metrics import Metrics, request_class
from tests.support.cluster import free_port
from tests.support.dashboard_series import DASHBOARD_SERIES, PER_REQUEST_HISTOGRAMS, samples


def _serve_one(m: Metrics, rid: str, priority: int, t0: float) -> Request:
    req = Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=3), priority=priority, arrival_time=t0)
    m.request_added([req])
    req.scheduled_time = t0 + 0.5
    m.request_scheduled(req, t0 + 0.5)
    req.first_token_time = t0 + 1.5
    m.first_token(req, t0 + 1.5)
    for i, now in enumerate((t0 + 1.5, t0 + 2.5, t0 + 3.5)):
        req.output_ids.append(i)
        m.tokens_generated(req, 1, now)
    req.finish_reason = FINISH_LENGTH
    m.request_finished(req, t0 + 4.0)
    return req


def test_request_series_come_from_the_request_timestamps():
    m = Metrics("tiny")
    _serve_one(m, "a", 0, 100.0)
    _serve_one(m, "b", -1, 200.0)
    got = {(s.name, s.labels.get("request_class")): s.value for s in samples(generate_latest(m.registry).decode())
           if s.labels.get("model_name") == "tiny"}
    assert got[("vllm:request_prefill_time_seconds_sum", None)] == 2 * 1.0
    assert got[("vllm:request_decode_time_seconds_sum", None)] == 2 * 2.0
    assert got[("vllm:request_inference_time_seconds_sum", None)] == 2 * 3.5
    assert got[("vllm:request_time_per_output_token_seconds_sum", None)] == 2 * 1.0  # 2 s over 2 gaps
    assert got[("vllm:request_prompt_tokens_sum", None)] == 8
    assert got[("vllm:request_generation_tokens_sum", None)] == 6
    assert got[("vllm:request_params_max_tokens_sum", None)] == 6
    for name in PER_REQUEST_HISTOGRAMS:
        assert got[(name + "_count", None)] == 2, name
    for cls in ("default", "high"):
        assert got[("llmserve:class_time_to_first_token_seconds_count", cls)] == 1
        assert got[("llmserve:class_e2e_request_latency_seconds_sum", cls)] == 4.0
    assert got[("llmserve:class_request_queue_time_seconds_count", "low")] == 0


def test_request_class_is_bounded():
    assert {request_class(p) for p in (-5, -1, 0, 1, 99)} == {"high", "default", "low"}


def test_api_page_carries_the_scheduler_series_or_says_why_not():
    sched = Metrics("tiny")
    _serve_one(sched, "a", 0, 0.0)
    port = free_port()
    sched.serve(port, host="127.0.0.1")
    api = HTTPMetrics()
    page = asyncio.run(scheduler_page(api, f"http://127.0.0.1:{port}/metrics")).decode()
    names = {s.name for s in samples(page)}
    for name in DASHBOARD_SERIES:
        assert any(n.startswith(name) for n in names), name
    assert [s.value for s in samples(page) if s.name == "llmserve:scheduler_metrics_up"] == [1]
    down = asyncio.run(scheduler_page(api, f"http://127.0.0.1:{free_port()}/metrics")).decode()
    assert "# scheduler metrics unavailable" in down
    assert [s.value for s in samples(down) if s.name == "llmserve:scheduler_metrics_up"] == [0]
    assert not any(s.name.startswith("vllm:") for s in samples(down))


def test_the_worker_named_model_replaces_the_placeholder():
    m = Metrics()  # "model" until the worker describes itself
    m.set_model_name("tiny")
    _serve_one(m, "a", 0, 0.0)
    names = {s.labels.get("model_name") for s in samples(generate_latest(m.registry).decode())}
    assert names == {"tiny"}
