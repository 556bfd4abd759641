"""The HTTP API's error handling without a scheduler: OpenAI's error body, the field named in `param`, the status
codes mapped from gRPC, and requests refused before they reach the scheduler (the app in this process, with a
scheduler address nobody listens on)."""

from __future__ import annotations

import socket

import grpc
import pytest
from fastapi.testclient import TestClient

from api_svc.app import APIConfig, create_app
from api_svc.errors import from_grpc


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(APIConfig(scheduler=_dead_address(), api_key="k")),
                    headers={"Authorization": "Bearer k"}) as c:
        yield c


@pytest.mark.parametrize("code, details, status, param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 7.0", 400, "top_p"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt (3 tokens) + sampling.max_tokens (9000) = 9003 exceeds max_model_len "
     "8192", 400, "max_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty (0 tokens)", 400, "prompt"),
    (grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role 'x' is unknown", 400, "messages"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is full: 2 requests queued", 429, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt (10 tokens) + max_tokens (5000) = 5010 tokens can never fit the KV "
     "pool", 400, "max_tokens"),
    (grpc.StatusCode.UNAVAILABLE, "no worker is registered", 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "waited longer than --queue-timeout 3s", 504, None),
])
def test_grpc_status_to_http(code, details, status, param):
    e = from_grpc(code, details)
    assert e.status == status and e.param == param
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and "sampling." not in body["message"]
    if status in (429, 503):
        assert e.headers["Retry-After"] == "1"


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": [1, -5]}, "prompt", "greater than or equal to 0"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "stop": 5}, "stop", "valid"),
    ({"max_tokens": 3}, "prompt", "Field required"),
])
def test_invalid_bodies_are_400_naming_the_field(client, body, param, words):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "BadRequestError"


def test_chat_content_parts_must_be_text(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_not_json_is_400(client):
    r = client.post("/v1/completions", content=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_missing_or_wrong_key_is_401(client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k"}):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert client.get("/version").status_code == 200  # not behind the key


def test_no_scheduler_is_503_with_retry_after(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert client.get("/health").status_code == 503


def test_metrics_count_requests_by_status(client):
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
    text = client.get("/metrics").text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="400"}' in text
    assert "http_time_to_first_byte_seconds_count" in text
