"""The smg gateway (the real `smg` binary of the test extra) in front of llmserve schedulers, over vLLM's gRPC engine
protocol: OpenAI HTTP through smg equals llmserve's own gRPC output; a disconnecting client's abort reaches llmserve;
bad input gets an error naming the field. The slow tests add a second pool: cache_aware against round_robin prefix
hits, and kill -9 of one pool's scheduler.

Pool A (worker + scheduler, own Redis namespace) serves the whole module; pool B starts only for the slow tests.
"""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest

from llmserve.bench.metrics import metric_sum, scrape
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster

WORKER_ARGS = ["--num-gpu-blocks-override", "512", "--max-model-len", "1024"]
SCHEDULER_ARGS = ["--max-num-batched-tokens", "512", "--lease-ttl-ms", "2000"]
# Fast health checks, so that a dead pool leaves the rotation (and a restarted one comes back) within seconds.
SMG_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold",
              "1", "--health-check-timeout-secs", "2"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]]


class Pool:
    """One scheduler + worker in its own Redis namespace."""

    def __init__(self, redis_url: str, worker: cluster.Proc):
        self.redis_url, self.worker = redis_url, worker
        self.port, self.metrics_port = cluster.free_port(), cluster.free_port()
        self.namespace = cluster.new_namespace("smg")
        self.start()

    def start(self) -> None:
        self.scheduler = cluster.start_scheduler(
            self.redis_url, self.worker, [*SCHEDULER_ARGS, "--port", self.port, "--metrics-port", self.metrics_port],
            namespace=self.namespace)
        cluster.wait_healthy(self.address, proc=self.scheduler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"), name, **labels)

    def active(self) -> int:
        with grpc.insecure_channel(self.address) as ch:
            return vpb_grpc.VllmEngineStub(ch).GetServerInfo(vpb.GetServerInfoRequest(), timeout=5).active_requests

    def drained(self, timeout: float) -> bool:
        """Within `timeout`: no active request and no KV block in use (cached free blocks do not count)."""
        deadline = time.monotonic() + timeout
        while self.active() or self.metric("vllm:kv_cache_usage_perc") > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


class Stack:
    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.a = Pool(redis_url, cluster.start_worker(WORKER_ARGS))
        self.smg = cluster.start_smg([self.a.address], "round_robin", SMG_HEALTH)
        self.url = f"http://127.0.0.1:{self.smg.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def smg_metric(self, name: str, **labels: str) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.smg.extra['metrics_port']}/metrics"), name, **labels)

    def grpc(self, req: pb.GenerateRequest) -> tuple[str, pb.Usage]:
        """llmserve.v1's own text and usage for `req` (pool A)."""
        text, usage = "", None
        with grpc.insecure_channel(self.a.address) as ch:
            for msg in pb_grpc.LLMServeStub(ch).Generate(req, timeout=120):
                text += msg.text
                if msg.finish_reason:
                    usage = msg.usage
        return text, usage


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    stack = Stack(redis_server)
    yield stack
    cluster.stop_all()


def test_completion_through_smg_equals_grpc(st):
    for prompt in PROMPTS:
        ref, usage = st.grpc(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True)))
        r = st.client.completions.create(model=st.model, prompt=prompt, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (usage.prompt_tokens, 10)
        chunks = list(st.client.completions.create(model=st.model, prompt=prompt, max_tokens=10, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_chat_through_smg_equals_grpc(st):
    for messages in CHATS:
        ref, usage = st.grpc(pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=16)))
        r = st.client.chat.completions.create(model=st.model, messages=messages, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == ref.strip() or r.choices[0].message.content == ref
        assert r.usage.prompt_tokens == usage.prompt_tokens
        assert r.usage.completion_tokens == usage.completion_tokens
        chunks = list(st.client.chat.completions.create(model=st.model, messages=messages, max_tokens=16,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == r.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_disconnecting_client_aborts_in_llmserve(st):
    aborted = st.a.metric("vllm:request_success_total", finished_reason="abort")
    closed = st.smg_metric("smg_http_responses_total", status_code="499")  # smg's count of clients that left
    body = {"model": st.model, "prompt": "Once upon a time", "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", st.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # generation has started; leave
    assert st.a.active() <= 1
    # 800 tokens take far longer than this wait: an idle pool now means the abort reached it
    assert st.a.drained(timeout=15)
    assert st.a.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert st.smg_metric("smg_http_responses_total", status_code="499") == closed + 1


@pytest.mark.parametrize("extra, field", [
    # A schema that does not compile (a valid one runs: tests/e2e/test_structured_outputs.py).
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "json_schema"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi " * 1100}]}, "context length"),
])
def test_bad_input_through_smg_names_the_field(st, extra, field):
    body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(st.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert st.a.drained(timeout=5)  # nothing left running, no KV block held
    ok = st.client.chat.completions.create(model=st.model, messages=CHATS[0], max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1


# ---- two pools ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet(st):
    st.b = Pool(st.redis_url, cluster.start_worker(WORKER_ARGS))
    return st


def _group_prompts(tag: str, groups: int = 4, per_group: int = 4) -> list[str]:
    """`groups` prefixes of ~512 tokens (each its own text), each followed by `per_group` different questions."""
    words = ["river", "bridge", "tower", "garden", "market", "harbor", "castle", "valley", "forest", "meadow"]
    out = []
    for g in range(groups):
        prefix = f"[{tag} document {g}] " + " ".join(f"{words[(g + i) % 10]}{i}" for i in range(170))
        out += [f"{prefix}\nQuestion {q}: what comes next?" for q in range(per_group)]
    return out


def _hits(pools: list[Pool]) -> float:
    return sum(p.metric("vllm:prefix_cache_hits_total") for p in pools)


@pytest.mark.slow
def test_cache_aware_computes_each_prefix_once(fleet):
    pools = [fleet.a, fleet.b]
    results = {}
    for policy in ("round_robin", "cache_aware"):
        gw = cluster.start_smg([p.address for p in pools], policy, SMG_HEALTH)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="none", max_retries=0, timeout=120)
        before = _hits(pools)
        prompts = _group_prompts(policy)
        for prompt in prompts:  # one at a time: a request finds the prefix its group's previous one left
            client.completions.create(model=fleet.model, prompt=prompt, max_tokens=1, temperature=0)
        results[policy] = _hits(pools) - before
        cluster.stop(gw)
    # round_robin alternates pools within a group: each prefix is computed on both (8 hitting requests of 16);
    # cache_aware keeps a group on one pool: computed once (12 hitting requests).
    assert results["round_robin"] > 0
    assert results["cache_aware"] * 2 == results["round_robin"] * 3, results


@pytest.mark.slow
def test_kill_one_pool_scheduler_then_restart(fleet):
    pools = [fleet.a, fleet.b]
    gw = cluster.start_smg([p.address for p in pools], "round_robin", SMG_HEALTH)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="none", max_retries=0, timeout=120)

    def served(pool: Pool) -> float:
        return pool.metric("vllm:request_success_total")

    def ask(k: int) -> None:
        for i in range(k):
            r = client.completions.create(model=fleet.model, prompt=f"Count to {i}:", max_tokens=2, temperature=0)
            assert r.usage.completion_tokens == 2

    cluster.kill(fleet.b.scheduler)
    deadline = time.monotonic() + 30
    while _healthy(gw) != 1:
        assert time.monotonic() < deadline, gw.log_tail()
        time.sleep(0.2)
    a0 = served(fleet.a)
    ask(6)
    assert served(fleet.a) == a0 + 6  # every new request went to the live pool

    fleet.b.start()  # same port and namespace: it takes the pool over from Redis once the dead one's lease expires
    deadline = time.monotonic() + 60
    while _healthy(gw) != 2:
        assert time.monotonic() < deadline, gw.log_tail()
        time.sleep(0.2)
    b0 = served(fleet.b)  # a new process: its counters start again
    ask(6)
    assert served(fleet.b) >= b0 + 2  # round_robin uses it again
    cluster.stop(gw)


def _healthy(gw: cluster.Proc) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{gw.port}/readiness", timeout=2).json().get("healthy_workers", 0)
    except (httpx.HTTPError, ValueError):
        return -1
