"""The public APIs under fuzzing, against real processes (redis-server, a worker with the bundled model, the scheduler
in this process, the HTTP API process):

- the OpenAI HTTP API, driven by its own OpenAPI document (schemathesis, valid and invalid bodies, bounded in count
  and time): no 5xx, every status, content type and body is the one the document declares, and /health keeps
  answering throughout (its worst latency is printed: a property of the run, not asserted);
- /health never waits behind a request: it answers while a body of the largest size allowed is being tokenized;
- the limits (body size, prompt count, n, stop, logit_bias, token-id prompt length) are 400/413 naming the field
  and the limit;
- the gRPC Generate request, with hypothesis over its fields: every call ends OK or with a refusal code and a
  message, never UNKNOWN or INTERNAL, and no KV block is left allocated afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

import grpc
import httpx
import pytest
import schemathesis
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from common.request_limits import MAX_N, MAX_STOP_STRINGS
from common.sampling_fields import MAX_LOGIT_BIAS
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.stack import Stack

MAX_MODEL_LEN = 128  # bounds the longest drawn generation (a valid body may ask for every token left)
BODY_LIMIT = 4 << 20
MAX_PROMPTS = 8
# Drawn examples: per operation and mode (valid bodies, invalid bodies) for the HTTP API, and gRPC Generate
# requests; more with LLMSERVE_TEST_ALL=1 (the slow tier: 20 and 80).
_ALL = os.environ.get("LLMSERVE_TEST_ALL") == "1"
EXAMPLES = 20 if _ALL else 6
GRPC_EXAMPLES = 80 if _ALL else 40
FUZZ_BUDGET_S = 240  # past this, the remaining examples are drawn but not sent
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS}


class HealthWatch:
    """Polls GET /health on its own connection while a test runs: the worst latency and every failed poll."""

    def __init__(self, url: str):
        self.url, self.worst, self.polls, self.failures = url, 0.0, 0, []
        self.answered_at: list[float] = []  # when each 200 arrived (time.monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self._stop.wait(0.05):
                t = time.monotonic()
                try:
                    status = http.get(self.url + "/health").status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                now = time.monotonic()
                self.worst = max(self.worst, now - t)
                self.polls += 1
                if status != 200:
                    self.failures.append(status)
                else:
                    self.answered_at.append(now)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def stack():
    with Stack(["--num-gpu-blocks-override", 64, "--max-model-len", MAX_MODEL_LEN, *cluster.FLOAT32]) as s:
        api = cluster.start_api(s.address, ["--max-request-body-bytes", BODY_LIMIT,
                                            "--max-prompts-per-request", MAX_PROMPTS])
        s.url = f"http://127.0.0.1:{api.port}"
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").status_code != 200 or httpx.get(s.url + "/v1/models").status_code != 200:
            assert time.monotonic() < deadline, api.log_tail()
            time.sleep(0.2)
        # The tokenizer loads once, at the first /v1/models; wait for it (building it holds the GIL for a while).
        assert httpx.post(s.url + "/tokenize", json={"prompt": "hi"}, timeout=300).status_code == 200
        try:
            yield s
        finally:
            cluster.stop(api)


def kv_is_clean(stack: Stack) -> dict:
    deadline = time.monotonic() + 30
    while stack.driver.core is not None and stack.driver.core.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    led = stack.scheduler.ledger.check_ledger()
    assert led["allocated"] == 0 and led["active"] == 0, led
    assert led["free"] + led["evictable"] == led["total"], f"a KV block leaked: {led}"
    return led


def test_openapi_document_describes_the_server(stack):
    doc = httpx.get(stack.url + "/openapi.json").json()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path  # invalid bodies are answered 400
            if "requestBody" in op:
                assert "400" in op["responses"] and "413" in op["responses"], path
            assert op["responses"]["200"].get("content"), path
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"application/json", "text/event-stream"} <= set(completions["200"]["content"])
    assert completions["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


def test_openai_api_under_schema_fuzzing(stack, record_property):
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    deadline = time.monotonic() + FUZZ_BUDGET_S
    failures: list[str] = []
    sent = 0

    with HealthWatch(stack.url) as health:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case) -> None:
                    nonlocal sent
                    if time.monotonic() > deadline:
                        return
                    response = case.call(base_url=stack.url, timeout=120)
                    sent += 1
                    try:
                        case.validate_response(response, checks=CHECKS)
                    except Exception as e:  # noqa: BLE001  (schemathesis raises a group of its failures: all collected)
                        failures.append(f"{case.operation.label} -> {response.status_code}: {str(e)[:600]}")

                try:
                    run()
                except Unsatisfiable:  # nothing invalid to draw for an operation without parameters or a body
                    assert mode == GenerationMode.NEGATIVE, op.label
    record_property("health_worst_s", round(health.worst, 3))
    print(f"\nschema fuzzing: {sent} requests; /health polled {health.polls} times, worst {health.worst:.3f} s")
    assert sent > 0
    assert not failures, "\n\n".join(failures[:10])
    assert not health.failures, f"/health failed during the run: {health.failures[:5]}"
    kv_is_clean(stack)


def _raw_post(url: str, path: str, body: bytes) -> socket.socket:
    """POST `body` on a raw socket and return once every byte is sent (the server is reading or processing it)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    return sock


def test_health_never_waits_behind_a_huge_request(stack):
    """A body just under the limit, tokenized by /tokenize: /health keeps answering while it is worked on. On a
    blocked event loop /health would fall silent from when the tokenizing starts until the answer, most of the
    request's time; here no silence between two /health answers lasts a quarter of it."""
    text = "the quick brown fox jumps over the lazy dog. " * ((BODY_LIMIT - 200) // 45)
    body = json.dumps({"prompt": text}).encode()
    assert len(body) < BODY_LIMIT
    with HealthWatch(stack.url) as health:
        sock = _raw_post(stack.url, "/tokenize", body)
        sent = time.monotonic()
        reply = bytearray()
        while chunk := sock.recv(1 << 16):
            reply.extend(chunk)
        answered = time.monotonic()
        sock.close()
    assert reply.startswith(b"HTTP/1.1 200"), bytes(reply[:300])
    marks = [sent, *(t for t in health.answered_at if sent < t < answered), answered]
    silence = max(b - a for a, b in itertools.pairwise(marks))
    print(f"\n/tokenize of {len(body)} bytes: {answered - sent:.2f} s; longest /health silence {silence:.3f} s")
    assert silence < (answered - sent) / 4, f"/health waited behind the request: silent {silence:.2f} s of " \
                                            f"{answered - sent:.2f} s"


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, limit", [
    ({"prompt": "hi", "n": MAX_N + 1}, "n", str(MAX_N)),
    ({"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", str(MAX_STOP_STRINGS)),
    ({"prompt": "hi", "stop": "x" * 1000}, "stop", "256"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", str(MAX_LOGIT_BIAS)),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt", str(MAX_PROMPTS)),
    ({"prompt": [1] * MAX_MODEL_LEN}, "prompt", str(MAX_MODEL_LEN)),
    ({"prompt": [[1], [1] * (MAX_MODEL_LEN + 5)]}, "prompt", str(MAX_MODEL_LEN)),
])
def test_limits_are_400_naming_the_field_and_the_limit(stack, body, param, limit):
    err = _error(httpx.post(stack.url + "/v1/completions", json=body, timeout=60), 400)
    assert err["param"] == param and limit in err["message"], err


def test_a_body_over_the_limit_is_413(stack):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    err = _error(httpx.post(stack.url + "/v1/completions", content=big, timeout=60,
                            headers={"Content-Type": "application/json"}), 413)
    assert str(BODY_LIMIT) in err["message"] and "--max-request-body-bytes" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // (1 << 16) + 1):
            yield b"a" * (1 << 16)
        yield b'"}'

    err = _error(httpx.post(stack.url + "/v1/completions", content=chunks(), timeout=60,
                            headers={"Content-Type": "application/json"}), 413)
    assert str(BODY_LIMIT) in err["message"]


def _read_response(sock: socket.socket, buffered: bytes) -> tuple[bytes, bytes, bytes]:
    """One HTTP/1.1 response with a Content-Length from `sock`: (head, body, bytes after it)."""
    data = buffered
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16) or pytest.fail(f"the server closed the connection after {data!r}")
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int({k.lower(): v for k, v in fields.items()}[b"content-length"])
    while len(rest) < length:
        rest += sock.recv(1 << 16) or pytest.fail("the server closed the connection inside a body")
    return head, rest[:length], rest[length:]


def test_a_refused_body_is_read_to_its_end_and_the_connection_kept(stack):
    # Unread bytes on a closed socket make the kernel send a reset that can destroy the 413 in flight, so the
    # server reads the refused body (dropping it) and the client's connection stays usable.
    host, port = stack.url.removeprefix("http://").split(":")
    body = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head, answer, rest = _read_response(sock, b"")
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" not in head.lower()
        assert str(BODY_LIMIT) in json.loads(answer)["error"]["message"]
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, _ = _read_response(sock, rest)
        assert head.startswith(b"HTTP/1.1 200")


# ---- gRPC Generate: hypothesis over the request's fields

def _value(fd, depth: int) -> st.SearchStrategy:
    """Values of one protobuf field: its whole wire range (and NaN/inf), short strings, small lists."""
    if fd.type == fd.TYPE_MESSAGE:
        if fd.message_type.GetOptions().map_entry:
            key, val = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            return st.dictionaries(_scalar(key), _scalar(val), max_size=4)
        inner = _message(fd.message_type, depth + 1)
        return st.lists(inner, max_size=3) if fd.is_repeated else inner
    scalar = _scalar(fd)
    return st.lists(scalar, max_size=6) if fd.is_repeated else scalar


_INTS = {FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
         FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1), FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1)}


def _scalar(fd) -> st.SearchStrategy:
    if fd.type in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):
        return st.floats(width=32 if fd.type == fd.TYPE_FLOAT else 64)
    if fd.type == fd.TYPE_BOOL:
        return st.booleans()
    if fd.type == fd.TYPE_STRING:
        return st.text(max_size=24)
    if fd.type == fd.TYPE_BYTES:
        return st.binary(max_size=24)
    if fd.type == fd.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])
    lo, hi = _INTS[fd.type]
    small = st.integers(max(lo, -3), min(hi, 40))  # where the interesting values are (max_tokens, n, ids)
    return st.one_of(small, st.integers(lo, hi))


@st.composite
def _message_values(draw, descriptor, depth: int) -> dict:
    fields = {}
    oneofs_done: set[str] = set()
    for fd in descriptor.fields:
        if depth > 2 or not draw(st.booleans()):
            continue
        oneof = fd.containing_oneof
        if oneof is not None:
            if oneof.name in oneofs_done:
                continue
            oneofs_done.add(oneof.name)
        fields[fd.name] = draw(_value(fd, depth))
    return fields


def _message(descriptor, depth: int) -> st.SearchStrategy:
    return _message_values(descriptor, depth)


def _build(cls, values: dict):
    msg = cls()
    for name, value in values.items():
        fd = cls.DESCRIPTOR.fields_by_name[name]
        if fd.type == fd.TYPE_MESSAGE and not fd.message_type.GetOptions().map_entry:
            sub = getattr(msg, name)
            if fd.is_repeated:
                for v in value:
                    _fill(sub.add(), v)
            else:
                _fill(sub, value)
        elif fd.is_repeated and fd.type != fd.TYPE_MESSAGE:
            getattr(msg, name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:  # a map
            getattr(msg, name).update(value)
        else:
            setattr(msg, name, value)
    return msg


def _fill(target, values: dict) -> None:
    target.CopyFrom(_build(type(target), values))
    if not values:
        target.SetInParent()


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = _build(pb.GenerateRequest, draw(_message(pb.GenerateRequest.DESCRIPTOR, 0)))
    # Mostly short generations, so that the accepted requests finish quickly on a CPU.
    if draw(st.integers(0, 9)):
        req.sampling.max_tokens = draw(st.integers(1, 6))
    if draw(st.integers(0, 3)):
        req.request_id = f"fuzz-{draw(st.uuids()).hex}"  # fresh ids: otherwise a re-attach to an earlier one
    return req


def test_grpc_generate_under_fuzzing(stack):
    outcomes: dict[str, int] = {}
    with grpc.insecure_channel(stack.address) as channel:
        stub = pb_grpc.LLMServeStub(channel)

        # Besides the drawn requests, one that must be served and one that must be refused: 80 random draws once held
        # no valid request at all (a CI run: 72 INVALID_ARGUMENT, 8 NOT_FOUND), which left "served" untested.
        @settings(max_examples=GRPC_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(req=generate_requests())
        @example(req=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=2)))
        @example(req=pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2)))  # no prompt
        def run(req: pb.GenerateRequest) -> None:
            try:
                for _ in stub.Generate(req, timeout=300):
                    pass
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                assert code in REFUSALS, f"{code.name}: {e.details()}\n{req}"
                assert e.details(), f"{code.name} without a message\n{req}"
            outcomes[code.name] = outcomes.get(code.name, 0) + 1

        run()
    print(f"\ngRPC Generate fuzzing: {outcomes}")
    assert outcomes.get("OK") and outcomes.get("INVALID_ARGUMENT")
    kv_is_clean(stack)
