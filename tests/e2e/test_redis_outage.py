"""Redis stopped (SIGSTOP) under a serving stack: redis-server, one CPU worker, a scheduler and the HTTP API, both on
that Redis through URLs with a short socket timeout, so that a call to the stopped server fails in seconds.

Every call on a request path meets the outage as the retryable status it is: gRPC UNAVAILABLE naming Redis (never
UNKNOWN), HTTP 503 with Retry-After. Once Redis runs again the same calls succeed with the tokens of an undisturbed
run, and the ledger ends clean (no active request, every KV block free). The scheduler's lease is long, so that
while it is idle it touches Redis only when a call needs it: a test that stops Redis then meets exactly the call it
makes, on a scheduler that still leads its pool (the window in which a re-attach used to end as UNKNOWN).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from common.client import Client
from llmserve.processes import start_redis
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster
from tests.support.waiting import wait_for

PROMPT = "Once upon a time, in a small village,"
MAX_TOKENS = 24
LONG_TOKENS = 96  # long enough to be stopped mid-generation
# redis-py retries a timed-out call a few times with backoff: a call to the stopped server fails within ~20 s.
# 2 s, not less: a loaded box must still start the stack within the timeout.
REDIS_QUERY = "?socket_timeout=2&socket_connect_timeout=2"
LEASE_TTL_MS = 600_000  # the idle driver renews every 200 s: within a test it leads without touching Redis
RPC_TIMEOUT_S = 60


class Stack:
    def __init__(self, root: str):
        self.redis = start_redis(os.path.join(root, "redis"))
        url = self.redis.url + REDIS_QUERY
        # The three start side by side (the scheduler waits for the worker, the API for the scheduler): on a loaded
        # box each start is mostly imports, so together they take about the longest one's time.
        worker_port = cluster.free_port()
        self.worker = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", 256,
                                            "--max-model-len", 512, "--port", worker_port], wait=False)
        self.sched = cluster.start_scheduler(url, f"127.0.0.1:{worker_port}",
                                             ["--lease-ttl-ms", LEASE_TTL_MS, "--debug-invariants",
                                              "--reattach-timeout", 120])
        self.api = cluster.start_api(self.sched.address, ["--redis-url", url, "--reattach-timeout", 120], wait=False)
        cluster.wait_ready(self.worker)
        cluster.wait_healthy(self.sched.address, timeout=120, proc=self.sched)
        cluster.wait_ready(self.api)
        self.url = f"http://127.0.0.1:{self.api.port}"
        self.channel = grpc.insecure_channel(self.sched.address)
        self.llmserve = pb_grpc.LLMServeStub(self.channel)
        self.vllm = vpb_grpc.VllmEngineStub(self.channel)
        self.ledger = cluster.ledger(self.redis.url, self.sched.namespace)
        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    @contextlib.contextmanager
    def redis_stopped(self):
        os.kill(self.redis.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.redis.pid, signal.SIGCONT)

    def health(self) -> str:
        return cluster.health(self.sched.address)

    def stop(self) -> None:
        self.channel.close()
        for proc in (self.api, self.sched, self.worker, self.redis):
            cluster.stop(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    st = Stack(str(tmp_path_factory.mktemp("outage")))
    yield st
    st.stop()


def sampling(max_tokens: int = MAX_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(st: Stack, rid: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    req = pb.GenerateRequest(request_id=rid, text=PROMPT, sampling=sampling(max_tokens))
    return [t for msg in st.llmserve.Generate(req, timeout=RPC_TIMEOUT_S) for t in msg.token_ids]


def vllm_generate(st: Stack, rid: str, ids: list[int]) -> list[int]:
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids, original_text=PROMPT),
                              sampling_params=vpb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [t for r in st.vllm.Generate(req, timeout=RPC_TIMEOUT_S) if r.HasField("complete")
            for t in r.complete.output_ids]


def embed(st: Stack, rid: str) -> list[float]:
    return list(st.llmserve.Embed(pb.EmbedRequest(request_id=rid, text=PROMPT), timeout=RPC_TIMEOUT_S).embedding)


def vllm_embed(st: Stack, rid: str, ids: list[int]) -> list[float]:
    req = vpb.EmbedRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids, original_text=PROMPT))
    return list(st.vllm.Embed(req, timeout=RPC_TIMEOUT_S).embedding)


def completion(st: Stack) -> httpx.Response:
    return httpx.post(st.url + "/v1/completions", timeout=RPC_TIMEOUT_S,
                      json={"model": st.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True})


def embeddings(st: Stack) -> httpx.Response:
    return httpx.post(st.url + "/v1/embeddings", json={"model": st.model, "input": PROMPT}, timeout=RPC_TIMEOUT_S)


def stored_response(st: Stack) -> httpx.Response:
    return httpx.get(st.url + "/v1/responses/resp_never_stored", timeout=RPC_TIMEOUT_S)


def rpc_code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def assert_clean(st: Stack) -> None:
    def idle():
        state = st.ledger.check_ledger()
        return state if state["free"] + state["evictable"] == state["total"] and not state["active"] else None

    state = wait_for("an idle ledger", idle, timeout=60)
    assert state["allocated"] == 0 and state["overlap"] == 0 and state["total"] == 256, state


@pytest.fixture(scope="module")
def reference(stack):
    """The undisturbed run of every call the outage tests repeat."""
    r = httpx.post(stack.url + "/tokenize", json={"model": stack.model, "prompt": PROMPT}, timeout=30)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    http = completion(stack)
    assert http.status_code == 200, http.text
    return {"ids": ids, "tokens": generate(stack, "ref-gen"), "long": generate(stack, "ref-long", LONG_TOKENS),
            "embedding": embed(stack, "ref-embed"), "text": http.json()["choices"][0]["text"],
            "vllm tokens": vllm_generate(stack, "ref-vgen", ids),
            "vllm embedding": vllm_embed(stack, "ref-vembed", ids)}


def test_every_request_path_answers_unavailable_while_redis_is_stopped_then_succeeds(stack, reference):
    ids = reference["ids"]
    calls = {
        "Generate": lambda: generate(stack, "site-gen"),
        "Embed": lambda: embed(stack, "site-embed"),
        "vllm Generate": lambda: vllm_generate(stack, "site-vgen", ids),
        "vllm Embed": lambda: vllm_embed(stack, "site-vembed", ids),
    }
    assert stack.health() == "SERVING"
    with stack.redis_stopped(), ThreadPoolExecutor(len(calls) + 3) as pool:
        # Each call looks its request id up in Redis (a re-attach would find its request there) on a scheduler
        # that still leads: the store failure itself must come back as UNAVAILABLE.
        grpc_calls = {name: pool.submit(rpc_code, call) for name, call in calls.items()}
        http_calls = {"completions": pool.submit(completion, stack), "embeddings": pool.submit(embeddings, stack),
                      "responses store": pool.submit(stored_response, stack)}
        codes = {name: f.result() for name, f in grpc_calls.items()}
        statuses = {name: f.result() for name, f in http_calls.items()}
        assert stack.health() == "SERVING", "the scheduler stood down: the calls met no Redis failure of their own"
    for name, (code, details) in codes.items():
        assert code == grpc.StatusCode.UNAVAILABLE, f"{name}: {code.name}: {details}"
        assert "Redis" in details and "retry" in details, f"{name}: {details}"
    for name, r in statuses.items():
        assert r.status_code == 503, f"{name}: {r.status_code} {r.text}"
        assert r.headers.get("retry-after") == "1", f"{name}: {dict(r.headers)}"
        assert r.json()["error"]["type"] == "ServiceUnavailableError", r.text
    # Redis is back: the same requests, by the same ids, succeed as in the undisturbed run.
    assert generate(stack, "site-gen") == reference["tokens"]
    assert vllm_generate(stack, "site-vgen", ids) == reference["vllm tokens"]
    assert embed(stack, "site-embed") == pytest.approx(reference["embedding"], abs=1e-4)
    assert vllm_embed(stack, "site-vembed", ids) == pytest.approx(reference["vllm embedding"], abs=1e-4)
    again = completion(stack)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference["text"], again.text
    vector = embeddings(stack)
    assert vector.status_code == 200, vector.text
    assert vector.json()["data"][0]["embedding"] == pytest.approx(reference["embedding"], abs=1e-4)
    assert stored_response(stack).status_code == 404
    assert_clean(stack)


class Follow:
    """One request read with common/client.py (which re-attaches by request id) in a thread of its own."""

    def __init__(self, address: str, rid: str, max_tokens: int):
        self.tokens: list[int] = []
        self.finish = ""
        self.first_unavailable: str | None = None  # the details of the first UNAVAILABLE that made it re-attach
        self.error: BaseException | None = None
        self.stream = None
        req = pb.GenerateRequest(request_id=rid, text=PROMPT, sampling=sampling(max_tokens))
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run(address, req)), daemon=True)
        self.thread.start()

    def _unavailable(self, e: grpc.aio.AioRpcError) -> None:
        self.first_unavailable = e.details()

    async def _run(self, address: str, req: pb.GenerateRequest) -> None:
        try:
            async with Client(address, reattach_timeout=180) as client:
                self.stream = client.generate(req, on_unavailable=self._unavailable)
                async for msg in self.stream:
                    self.tokens += msg.token_ids
                    self.finish = msg.finish_reason or self.finish
        except BaseException as e:  # noqa: BLE001  (UNKNOWN, a divergence: the test reports it)
            self.error = e

    @property
    def reattaches(self) -> int:
        return self.stream.reattaches if self.stream is not None else 0

    def join(self, timeout: float = 300) -> list[int]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream is still running"
        assert self.error is None, f"{type(self.error).__name__}: {self.error}"
        assert self.finish == "length", self.finish
        return self.tokens


def test_reattach_held_inside_the_outage_completes_with_the_undisturbed_tokens(stack, reference):
    # A request that finished before the outage: after the stand-down below the scheduler holds it in Redis only.
    assert generate(stack, "held-done") == reference["tokens"]

    # 1. Mid-generation: the commit to the stopped Redis fails, the scheduler stands by, the stream ends
    # UNAVAILABLE and its client re-attaches, again and again, inside the outage; then Redis comes back.
    live = Follow(stack.sched.address, "held-live", LONG_TOKENS)
    wait_for("tokens before the outage", lambda: len(live.tokens) >= 4)
    with stack.redis_stopped():
        wait_for("re-attaches inside the outage",
                 lambda: (live.reattaches >= 3 and stack.health() == "NOT_SERVING") or live.error)
        assert live.error is None, f"{type(live.error).__name__}: {live.error}"
        assert len(live.tokens) < LONG_TOKENS
    assert live.join() == reference["long"]
    assert "re-attach" in (live.first_unavailable or "")
    wait_for("the scheduler leading again", lambda: stack.health() == "SERVING")

    # 2. The finding's path: a re-attach reaches a scheduler that leads, does not hold the request in memory and
    # looks it up in Redis, which is stopped. UNAVAILABLE (naming Redis) until Redis answers; then every token.
    with stack.redis_stopped():
        done = Follow(stack.sched.address, "held-done", MAX_TOKENS)
        wait_for("re-attaches of the finished request", lambda: done.reattaches >= 2 or done.error)
        assert done.error is None, f"{type(done.error).__name__}: {done.error}"
        assert stack.health() == "SERVING" and not done.tokens
    assert done.join() == reference["tokens"]
    assert "Redis ledger" in (done.first_unavailable or ""), done.first_unavailable
    assert_clean(stack)


def test_abort_while_standing_by_is_unavailable_and_reaches_the_request_after(stack):
    live = Follow(stack.sched.address, "abort-live", LONG_TOKENS)
    wait_for("tokens before the outage", lambda: len(live.tokens) >= 4)
    with stack.redis_stopped():
        wait_for("the scheduler standing by", lambda: stack.health() == "NOT_SERVING")
        code, details = rpc_code(lambda: stack.llmserve.Abort(pb.AbortRequest(request_id="abort-live"),
                                                              timeout=RPC_TIMEOUT_S))
        assert code == grpc.StatusCode.UNAVAILABLE and "retry" in details, (code, details)
        code, details = rpc_code(lambda: stack.vllm.Abort(vpb.AbortRequest(request_ids=["abort-live"]),
                                                          timeout=RPC_TIMEOUT_S))
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)

    async def abort() -> bool:  # common/client.py retries UNAVAILABLE until the scheduler leads again
        async with Client(stack.sched.address) as client:
            return await client.abort("abort-live", timeout=120)

    assert asyncio.run(abort())
    live.thread.join(120)
    assert live.finish == "abort" and len(live.tokens) < LONG_TOKENS, (live.finish, live.error)
    assert_clean(stack)


def running(st: Stack) -> int:
    return st.vllm.GetLoads(vpb.GetLoadsRequest(), timeout=RPC_TIMEOUT_S).loads[0].num_running_reqs


def embed_across_a_stand_down(stack: Stack, call: Callable[[], None], result: dict, hold_s: float = 0.0) -> None:
    """Run `call` (one embedding, its vector put in `result`) in a thread while its step waits in a stopped worker
    and Redis is stopped under it, so that the step's commit fails and the scheduler stands by with the request in
    hand; return once the call has ended, with no error in `result`."""

    def follow() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001  (the assertion below reports it)
            result["error"] = e

    os.kill(stack.worker.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        wait_for("the embedding's step sent to the stopped worker", lambda: running(stack) or "error" in result)
        with stack.redis_stopped():
            os.kill(stack.worker.pid, signal.SIGCONT)
            wait_for("the scheduler standing by", lambda: stack.health() == "NOT_SERVING" or "error" in result)
            time.sleep(hold_s)
            assert "error" not in result, result["error"]
    finally:
        os.kill(stack.worker.pid, signal.SIGCONT)
    thread.join(300)
    assert not thread.is_alive() and "error" not in result, result.get("error")


def test_embed_accepted_before_the_outage_is_sent_again_and_returns_the_undisturbed_vector(stack, reference):
    # The worker is stopped, so the accepted embedding's step waits in it; Redis is stopped before the worker
    # answers, so the step's commit fails and the scheduler stands by with the request in hand: the call ends
    # UNAVAILABLE after the accepted header, and common/client.py sends it again until the scheduler leads.
    result: dict = {}

    async def run() -> None:
        async with Client(stack.sched.address, reattach_timeout=180) as client:
            result["embedding"] = list((await client.embed(pb.EmbedRequest(request_id="held-embed",
                                                                          text=PROMPT))).embedding)

    embed_across_a_stand_down(stack, lambda: asyncio.run(run()), result)
    assert result["embedding"] == pytest.approx(reference["embedding"], abs=1e-4)
    wait_for("the scheduler leading again", lambda: stack.health() == "SERVING")
    assert_clean(stack)


def test_vllm_embed_accepted_before_the_outage_is_held_and_returns_the_undisturbed_vector(stack, reference):
    # As above, through vLLM's engine protocol: a gateway that never sends the call again. The scheduler holds the
    # Embed itself across the stand-down (servers/held_embed.py) and answers it once it leads again.
    result: dict = {}

    def call() -> None:
        result["embedding"] = vllm_embed(stack, "vheld-embed", reference["ids"])

    mark = len(stack.sched.log_text())
    embed_across_a_stand_down(stack, call, result, hold_s=1.0)  # held inside the outage, not only across it
    assert "standing by" in stack.sched.log_text()[mark:], "the scheduler never stood down: nothing was tested"
    assert result["embedding"] == pytest.approx(reference["vllm embedding"], abs=1e-4)
    wait_for("the scheduler leading again", lambda: stack.health() == "SERVING")
    assert_clean(stack)


class VllmFollow:
    """One streamed request of vLLM's engine protocol (what smg sends), read in a thread of its own: a client that
    never re-attaches, so the scheduler must hold its stream open across a stand-down."""

    def __init__(self, st: Stack, rid: str, ids: list[int], max_tokens: int):
        self.chunks: list[int] = []  # the streamed tokens, in order
        self.complete: vpb.GenerateComplete | None = None
        self.error: BaseException | None = None
        req = vpb.GenerateRequest(request_id=rid, stream=True,
                                  tokenized=vpb.TokenizedInput(input_ids=ids, original_text=PROMPT),
                                  sampling_params=vpb.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                     ignore_eos=True))
        self.thread = threading.Thread(target=self._run, args=(st, req), daemon=True)
        self.thread.start()

    def _run(self, st: Stack, req: vpb.GenerateRequest) -> None:
        try:
            for r in st.vllm.Generate(req, timeout=300):
                if r.HasField("chunk"):
                    self.chunks += r.chunk.token_ids
                else:
                    self.complete = r.complete
        except BaseException as e:  # noqa: BLE001  (UNAVAILABLE before the fix: the test reports it)
            self.error = e

    def join(self, timeout: float = 300) -> list[int]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream is still running"
        assert self.error is None, f"{type(self.error).__name__}: {self.error}"
        assert self.complete is not None and self.complete.finish_reason == "length", self.complete
        assert list(self.complete.output_ids) == self.chunks, "the final message differs from the streamed tokens"
        assert self.complete.completion_tokens == len(self.chunks)
        return self.chunks


def test_vllm_engine_stream_is_held_across_a_stand_down_and_completes_undisturbed(stack, reference):
    ids = reference["ids"]
    undisturbed = VllmFollow(stack, "vheld-ref", ids, LONG_TOKENS).join()

    # 1. The lease is taken away mid-generation (a lapse does it): the next commit is fenced, the scheduler stands
    # down, takes the pool again and resumes the request by recompute; the stream goes on as if nothing happened.
    mark = len(stack.sched.log_text())
    lapsed = VllmFollow(stack, "vheld-lease", ids, LONG_TOKENS)
    wait_for("tokens before the lapse", lambda: len(lapsed.chunks) >= 4 or lapsed.error)
    stack.ledger.client.delete(stack.ledger.k_lease)
    assert lapsed.join() == undisturbed
    assert "lost the lease" in stack.sched.log_text()[mark:], "the scheduler kept its lease: nothing was tested"
    assert_clean(stack)

    # 2. Redis stopped mid-generation: the commit fails, the scheduler stands by (NOT_SERVING) for as long as the
    # outage lasts, the stream is held open meanwhile and completes once Redis answers again.
    held = VllmFollow(stack, "vheld-redis", ids, LONG_TOKENS)
    wait_for("tokens before the outage", lambda: len(held.chunks) >= 4 or held.error)
    with stack.redis_stopped():
        wait_for("the scheduler standing by", lambda: stack.health() == "NOT_SERVING" or held.error)
        time.sleep(1.0)  # held inside the outage, not only across the stand-down
        assert held.error is None, f"{type(held.error).__name__}: {held.error}"
        assert len(held.chunks) < LONG_TOKENS
    assert held.join() == undisturbed
    wait_for("the scheduler leading again", lambda: stack.health() == "SERVING")
    assert_clean(stack)
