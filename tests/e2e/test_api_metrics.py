"""vLLM's dashboard series on the API port: `llmserve serve` (redis-server, worker, scheduler, API), a few real
requests of two classes, then GET /metrics on the HTTP port parsed with prometheus_client."""

import httpx

from tests.support import cluster
from tests.support.dashboard_series import DASHBOARD_SERIES, PER_REQUEST_HISTOGRAMS, samples

PRIORITIES = (0, 0, -1)  # two default-class requests and one high-class one


def test_dashboard_series_on_the_api_port():
    serve = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 64, "--max-model-len", 512])
    try:
        http = f"http://127.0.0.1:{serve.extra['http_port']}"
        for priority in PRIORITIES:
            r = httpx.post(http + "/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True, "priority": priority})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        page = httpx.get(http + "/metrics", timeout=30)
        assert page.status_code == 200
        got = samples(page.text)
        model = {s.labels.get("model_name") for s in got if s.name.startswith("vllm:")} - {None}
        assert len(model) == 1, model
        for name in DASHBOARD_SERIES:
            assert any(s.name.startswith(name) and "model_name" in s.labels for s in got), name
        counts = {s.name: s.value for s in got if s.name.endswith("_count") and "request_class" not in s.labels}
        for name in PER_REQUEST_HISTOGRAMS:
            assert counts[name + "_count"] == len(PRIORITIES), name
        by_class = {s.labels["request_class"]: s.value for s in got
                    if s.name == "llmserve:class_e2e_request_latency_seconds_count"}
        assert by_class == {"high": 1, "default": 2, "low": 0}
        assert any(s.name.startswith("http_requests") for s in got)  # the API's own series beside them
    finally:
        assert cluster.stop(serve, timeout=30) == 0, serve.log_tail()
