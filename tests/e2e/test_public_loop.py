"""The public API on one event loop (grpc.aio), end to end on a 2-layer random Llama: 256 concurrent greedy streams
are served right without a thread per stream, and a committed step wakes only the streams whose requests got news.
Real worker process, real Redis, real gRPC."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import psutil
import pytest

from experiments.scheduler_overhead import make_tiny_llama
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster

VOCAB = 512
STREAMS = 256
MAX_TOKENS = 48
PROMPTS = [[3 + (37 * i + 11 * j) % (VOCAB - 3) for j in range(8)] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory):
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), vocab_size=VOCAB, hidden_size=64,
                            max_position_embeddings=1024)
    worker = cluster.start_worker(["--model", model, "--dtype", "float32", "--device", "cpu",
                                   "--num-gpu-blocks-override", 1200, "--max-model-len", 256])
    try:
        yield worker
    finally:
        cluster.stop(worker)


def _request(prompt: list[int], request_id: str = "", max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _generate_all(address: str, prompts: list[list[int]]) -> list[tuple[str, list[int], str]]:
    """Every prompt as its own stream, all at once on one channel: (text, token ids, finish reason) each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.LLMServeStub(channel)

        async def one(prompt: list[int]) -> tuple[str, list[int], str]:
            text, ids, finish = "", [], ""
            async for msg in stub.Generate(_request(prompt), timeout=300):
                text += msg.text
                ids += msg.token_ids
                finish = msg.finish_reason or finish
            return text, ids, finish

        return await asyncio.gather(*(one(p) for p in prompts))


def test_256_concurrent_streams_on_one_loop_equal_the_single_stream_text(redis_server, tiny_worker):  # noqa: F811
    sched = cluster.start_scheduler(redis_server, tiny_worker, ["--max-num-seqs", STREAMS,
                                                                "--max-num-batched-tokens", 4096])
    try:
        cluster.wait_healthy(sched.address)
        alone = {tuple(p): asyncio.run(_generate_all(sched.address, [p]))[0] for p in PROMPTS}
        proc = psutil.Process(sched.popen.pid)
        idle_threads = proc.num_threads()
        peak = [idle_threads]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak[0] = max(peak[0], proc.num_threads())

        sampler = threading.Thread(target=sample)
        sampler.start()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
        try:
            results = asyncio.run(_generate_all(sched.address, prompts))
        finally:
            stop.set()
            sampler.join()
    finally:
        cluster.stop(sched)
    for prompt, (text, ids, finish) in zip(prompts, results, strict=True):
        ref_text, ref_ids, _ = alone[tuple(prompt)]
        assert finish == "length" and len(ids) == MAX_TOKENS
        assert ids == ref_ids and text == ref_text
    # A thread per open stream would put 256 more threads in the scheduler; the loop and its small thread pool
    # (admission) do not grow with the number of streams.
    assert peak[0] < idle_threads + 40, (idle_threads, peak[0])


def _on_loop(loop: asyncio.AbstractEventLoop, fn):
    """Run `fn` on the server's event loop (the watches live there) and return its result."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    loop.call_soon_threadsafe(lambda: fut.set_result(fn()))
    return fut.result(10)


def test_a_committed_step_wakes_only_the_streams_with_news(redis_server, tiny_worker):  # noqa: F811
    """One request runs (--max-num-seqs 1) while a second waits in the queue: each committed step wakes the running
    request's stream only; the queued one sleeps until its own tokens come."""
    from tests.support.stack import start_scheduler_in_process

    sched = start_scheduler_in_process(redis_server, tiny_worker, ["--namespace", cluster.new_namespace("wake"),
                                                                   "--max-num-seqs", 1])
    loop, outbox = sched.server.loop, sched.driver.outbox
    got: dict[str, list[int]] = {"a": [], "b": []}

    def stream(rid: str, max_tokens: int) -> None:
        with grpc.insecure_channel(sched.address) as ch:
            for msg in pb_grpc.LLMServeStub(ch).Generate(_request(PROMPTS[0], rid, max_tokens), timeout=300):
                got[rid] += msg.token_ids

    def watch_of(rid: str):
        return _on_loop(loop, lambda: next(iter(outbox._watches.get(rid, ())), None))

    def wait_until(what: str, cond, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    threads = [threading.Thread(target=stream, args=("a", 200))]
    try:
        threads[0].start()
        wait_until("the first token of a", lambda: len(got["a"]) > 0)
        threads.append(threading.Thread(target=stream, args=("b", 8)))
        threads[1].start()
        wait_until("b's stream to watch", lambda: watch_of("b") is not None)
        w_a, w_b = watch_of("a"), watch_of("b")
        steps0, wakes0 = sched.driver.step_id, w_a.wakes
        wait_until("a to stream 40 more tokens", lambda: len(got["a"]) > 40 + 8)
        assert len(got["a"]) < 200, "a finished too early for the check"
        steps1, wakes1 = sched.driver.step_id, w_a.wakes
        assert w_b.wakes == 0 and got["b"] == []  # queued: no news, no wake-up
        # a woke for its tokens, at most once per committed step (the loop may merge several steps into one wake).
        assert 0 < wakes1 - wakes0 <= steps1 - steps0 + 2
        for t in threads:
            t.join(timeout=120)
        assert len(got["a"]) == 200 and len(got["b"]) == 8
        assert 0 < w_b.wakes <= 8 + 1  # once running, b wakes for its own tokens and its finish
    finally:
        sched.stop()
