"""`llmserve serve` as one process: worker flags reach its worker, and it supervises its children -- kill -9 of its
private redis-server and then of its worker, under load, changes no stream's tokens (clients use
`llmserve.client.stream`, which re-attaches on UNAVAILABLE), and a worker that can never start ends `serve` with
the worker's log; `serve` killed with SIGKILL takes its children with it."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading

import grpc
import httpx
import psutil
import pytest

from llmserve import client
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.waiting import wait_for

STREAMS, MAX_TOKENS = 8, 56


def children(serve: cluster.Proc) -> dict[str, psutil.Process]:
    """serve's live redis-server, worker and HTTP API processes, by role."""
    out = {}
    for p in psutil.Process(serve.pid).children():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:  # gone, or a zombie not reaped yet
            continue
        if "redis-server" in cmd:
            out["redis"] = p
        elif "llmserve.cli worker" in cmd:
            out["worker"] = p
        elif "llmserve.cli api" in cmd:
            out["api"] = p
    return out


def redis_url(serve: cluster.Proc) -> str:
    return re.search(r" redis (redis://\S+);", serve.log_text()).group(1)


def test_serve_with_a_pool_below_max_model_len_answers(tmp_path):
    serve = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 16, "--max-model-len", 512,
                                 "--allow-kv-pool-below-max-model-len"])
    kids = children(serve)
    assert set(kids) == {"redis", "worker", "api"}
    try:
        http = f"http://127.0.0.1:{serve.extra['http_port']}"
        assert f"OpenAI API on {http}/v1" in serve.log_text()  # the ready line names the URL
        chat = httpx.post(http + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4, chat.text
        with grpc.insecure_channel(serve.address) as ch:
            info = pb_grpc.LLMServeStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.num_blocks, info.max_model_len) == (16, 512)
        out = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--server", serve.address, "--json",
                              "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "Once upon a time"],
                             cwd=cluster.ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        final = json.loads(out.stdout.splitlines()[-1])
        assert final["finish_reason"] == "length" and len(final["token_ids"]) == 8
    finally:
        assert cluster.stop(serve, timeout=30) == 0, serve.log_tail()
    assert not [p for p in kids.values() if p.is_running()], "serve left its children running"


def test_serve_killed_by_sigkill_leaves_no_children():
    serve = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 16, "--max-model-len", 512,
                                 "--allow-kv-pool-below-max-model-len"])
    kids = children(serve)
    assert set(kids) == {"redis", "worker", "api"}
    cluster.kill(serve)
    _, alive = psutil.wait_procs(list(kids.values()), timeout=30)
    assert not alive, f"orphans of a SIGKILLed serve: {alive}"


class Streams:
    """STREAMS concurrent greedy requests (token-id prompts, ignore_eos), each re-attaching on UNAVAILABLE."""

    def __init__(self, address: str, tag: str):
        rng = random.Random(7)
        self.prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(8, 24))] for _ in range(STREAMS)]
        self.tokens = [0] * STREAMS  # streamed so far, per request
        self.results: list[client.Result | BaseException | None] = [None] * STREAMS
        self.threads = [threading.Thread(target=self._run, args=(address, f"{tag}-{i}", i), daemon=True)
                        for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, address: str, rid: str, i: int) -> None:
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=self.prompts[i]),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))

        def count(msg: pb.GenerateResponse) -> None:
            self.tokens[i] += len(msg.token_ids)

        try:
            self.results[i] = client.stream(req, address, retry_seconds=120, on_message=count)
        except BaseException as e:  # shown by the assertion in `outputs`
            self.results[i] = e

    def outputs(self, timeout: float = 300.0) -> list[list[int]]:
        for t in self.threads:
            t.join(timeout)
        for i, r in enumerate(self.results):
            assert isinstance(r, client.Result), f"stream {i}: {r!r}"
            assert r.finish == ["length"], f"stream {i}: {r.finish}"
        return [r.token_ids[0] for r in self.results]


@pytest.mark.slow
def test_serve_restarts_killed_redis_and_worker_and_streams_lose_nothing():
    serve = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 256, "--max-model-len", 1024,
                                 "--max-num-batched-tokens", 256, "--http-port", 0])  # 0: no HTTP API
    try:
        assert set(children(serve)) == {"redis", "worker"}
        reference = Streams(serve.address, "ref").outputs()
        assert all(len(r) == MAX_TOKENS for r in reference)

        streams = Streams(serve.address, "chaos")
        procs = children(serve)
        wait_for("8 tokens in every stream", lambda: min(streams.tokens) >= 8, watch=serve)
        procs["redis"].kill()
        new_redis = wait_for("a new redis-server", lambda: (c := children(serve).get("redis")) and
                             c.pid != procs["redis"].pid and c, watch=serve)
        # The new redis-server loaded the append-only file: the pool and every unfinished request are still there.
        state = cluster.ledger(redis_url(serve), "llmserve").check_ledger()
        assert state["active"] == STREAMS and state["total"] == 256, state
        wait_for("SERVING after the redis-server restart", lambda: cluster.health(serve.address) == "SERVING",
                 watch=serve)
        at_redis = list(streams.tokens)
        wait_for("progress after the redis-server restart",
                 lambda: all(t > a or t == MAX_TOKENS for t, a in zip(streams.tokens, at_redis, strict=True)),
                 watch=serve)
        assert min(streams.tokens) < MAX_TOKENS, "the streams finished before the worker could be killed"
        procs["worker"].kill()
        wait_for("a new worker", lambda: (c := children(serve).get("worker")) and c.pid != procs["worker"].pid,
                 watch=serve)
        outputs = streams.outputs()

        assert outputs == reference, "a stream's tokens differ from the undisturbed run"
        assert serve.alive() and children(serve)["redis"].pid == new_redis.pid
        wait_for("SERVING at the end", lambda: cluster.health(serve.address) == "SERVING", watch=serve, timeout=30)
        log = serve.log_text()
        assert "the redis-server exited" in log and "the worker exited" in log, log[-4000:]
    finally:
        assert cluster.stop(serve, timeout=30) == 0, serve.log_tail()


def test_a_worker_that_never_starts_ends_serve_naming_it(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    serve = cluster.start_serve(["--device", "cpu", "--model", missing, "--log-dir", tmp_path], wait=False)
    try:
        rc = serve.popen.wait(timeout=150)
    finally:
        cluster.stop(serve)
    log = serve.log_text()
    assert rc == 1, log[-4000:]
    assert "the worker exited 6 times within 60 s" in log, log[-4000:]
    assert "Last lines of its log" in log and str(missing) in log.rsplit("giving up", 1)[1], log[-4000:]
    assert "llmserve ready" not in log
    assert "unsupported model path" in (tmp_path / "worker.log").read_text()  # --log-dir keeps every run's log
