"""Requests that wait in the queue are answered, as vLLM's are, also when the scheduler loses its lease meanwhile.

A scheduler on an overloaded host can stall for longer than its --lease-ttl-ms (every process of the box waits for a
CPU); its lease lapses, it steps down, takes the pool again from Redis and resumes every request. Streams end with
UNAVAILABLE at the step-down and the HTTP API re-attaches by request id. It used to do so only for requests that had
a token already: every request still queued got HTTP 503. Here `llmserve serve` runs one sequence at a time
(--max-num-seqs 1), so that most requests queue, and the lease is taken away while they do, the way a lapse does it
(the key is deleted in Redis), without depending on how fast this machine is. And an idle worker that answers the
scheduler's probe late is not taken for lost, which used to refuse every request that came meanwhile.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import psutil
import pytest

from common import public_protocol
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.waiting import wait_for

NUM_REQUESTS = 5
MAX_TOKENS = 48
PROMPT = "Once upon a time, in a small village,"


def queued_requests(ledger, rids: list[str]) -> list[str]:
    """The requests of `rids` that Redis holds with no output yet (waiting for the one batch slot)."""
    return [rid for rid in rids if (req := ledger.get_request(rid)) is not None and not req.output_ids
            and not req.finished]


@pytest.fixture(scope="module")
def served(redis_server):
    """`llmserve serve` on the session's Redis (the test reads and edits its ledger), one sequence at a time."""
    namespace = cluster.new_namespace("queued")
    serve = cluster.start_serve(["--redis-url", redis_server, "--namespace", namespace, "--max-num-seqs", "1",
                                 "--num-gpu-blocks-override", "64", "--max-model-len", "256"])
    try:
        yield serve, cluster.ledger(redis_server, namespace)
    finally:
        cluster.stop(serve)


def wait_idle(ledger, serve) -> dict:
    def idle():
        state = ledger.check_ledger()
        return state if state["free"] + state["evictable"] == state["total"] and not state["active"] else None

    return wait_for("an idle ledger", idle, timeout=60, watch=serve)


def test_queued_requests_survive_a_lapsed_lease(served):
    serve, ledger = served
    url = f"http://127.0.0.1:{serve.extra['http_port']}/v1/completions"
    rids = [f"queued-{k}" for k in range(NUM_REQUESTS)]
    mark = len(serve.log_text())

    async def one(client: httpx.AsyncClient, rid: str) -> httpx.Response:
        return await client.post(url, headers={"x-request-id": rid}, json={
            "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            calls = [asyncio.create_task(one(client, rid)) for rid in rids]
            # Several requests wait in the queue; then the lease goes, as a stall past its TTL loses it.
            await asyncio.to_thread(wait_for, "two queued requests",
                                    lambda: len(queued_requests(ledger, rids)) >= 2, watch=serve)
            ledger.client.delete(ledger.k_lease)
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert "lost the lease" in serve.log_text()[mark:], "the scheduler kept its lease: nothing was tested"
    bodies = [(r.status_code, r.text[:300]) for r in replies]
    assert all(r.status_code == 200 for r in replies), bodies
    texts = {r.json()["choices"][0]["text"] for r in replies}
    usage = [r.json()["usage"]["completion_tokens"] for r in replies]
    assert usage == [MAX_TOKENS] * NUM_REQUESTS
    assert len(texts) == 1, f"one greedy prompt, several answers: {texts}"  # resumed requests recompute alike
    state = wait_idle(ledger, serve)
    assert state["allocated"] == 0 and state["overlap"] == 0, state


def worker_of(serve) -> psutil.Process:
    return next(p for p in psutil.Process(serve.pid).children() if "llmserve.cli worker" in " ".join(p.cmdline()))


def test_a_late_idle_worker_keeps_taking_requests(served):
    """An idle worker that answers the scheduler's probe late (a busy host; here: SIGSTOP) is not taken for lost: a
    request that comes meanwhile is accepted and waits for it, instead of UNAVAILABLE (HTTP 503)."""
    serve, ledger = served
    wait_idle(ledger, serve)
    worker, mark = worker_of(serve), len(serve.log_text())
    worker.suspend()
    try:
        wait_for("a late answer to the idle probe",
                 lambda: any(s in serve.log_text()[mark:] for s in ("did not answer within", "worker step failed")),
                 watch=serve)

        async def run() -> list[pb.GenerateResponse]:
            async with grpc.aio.insecure_channel(serve.address) as channel:
                req = pb.GenerateRequest(request_id="late-worker", text=PROMPT,
                                         sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True))
                call = pb_grpc.LLMServeStub(channel).Generate(req)
                assert public_protocol.accepted(await call.initial_metadata()), await call.details()
                worker.resume()
                return [msg async for msg in call]

        messages = asyncio.run(run())
    finally:
        worker.resume()
    assert messages[-1].finish_reason == "length" and sum(len(m.token_ids) for m in messages) == 8
    wait_idle(ledger, serve)
