"""Requests that wait in the queue are answered, as vLLM's are, also when the scheduler loses its lease meanwhile.

A scheduler on an overloaded host can stall for longer than its --lease-ttl-ms (every process of the box waits for a
CPU); its lease lapses, it steps down, takes the pool again from Redis and resumes every request. Streams end with
UNAVAILABLE at the step-down and the HTTP API re-attaches by request id. It used to do so only for requests that had
a token already: every request still queued got HTTP 503. Here `llmserve serve` runs one sequence at a time
(--max-num-seqs 1), so that most requests queue, and the lease is taken away while they do, the way a lapse does it
(the key is deleted in Redis), without depending on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support import cluster

NUM_REQUESTS = 5
MAX_TOKENS = 48
PROMPT = "Once upon a time, in a small village,"


def wait_for(what: str, cond, proc, timeout: float = 120.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert proc.alive(), proc.log_tail()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
    return value


def queued_requests(ledger, rids: list[str]) -> list[str]:
    """The requests of `rids` that Redis holds with no output yet (waiting for the one batch slot)."""
    return [rid for rid in rids if (req := ledger.get_request(rid)) is not None and not req.output_ids
            and not req.finished]


def test_queued_requests_survive_a_lapsed_lease(redis_server):
    namespace = cluster.new_namespace("queued")
    serve = cluster.start_serve(["--redis-url", redis_server, "--namespace", namespace, "--max-num-seqs", "1",
                                 "--num-gpu-blocks-override", "64", "--max-model-len", "256"])
    ledger = cluster.ledger(redis_server, namespace)
    url = f"http://127.0.0.1:{serve.extra['http_port']}/v1/completions"
    rids = [f"queued-{k}" for k in range(NUM_REQUESTS)]
    try:
        async def one(client: httpx.AsyncClient, rid: str) -> httpx.Response:
            return await client.post(url, headers={"x-request-id": rid}, json={
                "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as client:
                calls = [asyncio.create_task(one(client, rid)) for rid in rids]
                # Several requests wait in the queue; then the lease goes, as a stall past its TTL loses it.
                await asyncio.to_thread(wait_for, "two queued requests",
                                        lambda: len(queued_requests(ledger, rids)) >= 2, serve)
                ledger.client.delete(ledger.k_lease)
                return await asyncio.gather(*calls)

        replies = asyncio.run(run())
        log = serve.log_text()[serve.log_start:]
        assert "lost the lease" in log, "the scheduler never lost its lease: the test did not test anything"
        bodies = [(r.status_code, r.text[:300]) for r in replies]
        assert all(r.status_code == 200 for r in replies), bodies
        texts = {r.json()["choices"][0]["text"] for r in replies}
        usage = [r.json()["usage"]["completion_tokens"] for r in replies]
        assert usage == [MAX_TOKENS] * NUM_REQUESTS
        assert len(texts) == 1, f"one greedy prompt, several answers: {texts}"  # resumed requests recompute alike

        def idle():
            state = ledger.check_ledger()
            return state if state["free"] + state["evictable"] == state["total"] and not state["active"] else None

        state = wait_for("an idle ledger", idle, serve, timeout=30)
        assert state["allocated"] == 0 and state["overlap"] == 0, state
    finally:
        cluster.stop(serve)
