"""The bound on a vLLM-protocol call held across a stand-down, --reattach-timeout (servers/held_stream.py,
servers/held_embed.py).

A scheduler (real redis-server, worker and scheduler processes) whose lease is taken by another holder stands by
and cannot lead again: a streamed vLLM `Generate` it had admitted is held for --reattach-timeout (2 s here) and then
ends UNAVAILABLE naming the setting, and so does an admitted `Embed`; a stream the gateway cancels while held is
aborted once the scheduler leads again; a request that comes while it stands by is refused at once, as before. Once
the lease is free again the scheduler leads, and the ledger ends with every KV block free. The happy paths (a
deleted lease key, Redis stopped) are in tests/e2e/test_redis_outage.py.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster
from tests.support.waiting import wait_for

MAX_TOKENS = 96  # long enough to be interrupted mid-generation
REATTACH_TIMEOUT_S = 2
PROMPT_IDS = list(range(10, 30))
FOREIGN_LEASE = "another-scheduler:999999"


@pytest.fixture(scope="module")
def stack(redis_server):
    worker = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", 128, "--max-model-len", 256])
    sched = None
    try:
        sched = cluster.start_scheduler(redis_server, worker, ["--reattach-timeout", REATTACH_TIMEOUT_S,
                                                               "--debug-invariants"])
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        channel = grpc.insecure_channel(sched.address)
        yield sched, vpb_grpc.VllmEngineStub(channel), cluster.ledger(redis_server, sched.namespace), worker
        channel.close()
    finally:
        for proc in (sched, worker):
            if proc is not None:
                cluster.stop(proc)


def request(rid: str) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, stream=True, tokenized=vpb.TokenizedInput(input_ids=PROMPT_IDS),
                               sampling_params=vpb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True))


class Follow:
    def __init__(self, stub, rid: str):
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.call = stub.Generate(request(rid), timeout=300)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for r in self.call:
                if r.HasField("chunk"):
                    self.tokens += r.chunk.token_ids
        except grpc.RpcError as e:
            self.error = e


def test_a_held_stream_ends_unavailable_naming_the_bound_and_a_cancelled_one_is_aborted(stack):
    sched, stub, ledger, _ = stack
    ended, cancelled = Follow(stub, "bound-ended"), Follow(stub, "bound-cancelled")
    wait_for("tokens before the lease is taken", lambda: len(ended.tokens) >= 4 and len(cancelled.tokens) >= 4)
    mark = len(sched.log_text())
    ledger.client.set(ledger.k_lease, FOREIGN_LEASE, px=600_000)  # another scheduler leads: this one stands by
    try:
        wait_for("the scheduler standing by", lambda: cluster.health(sched.address) == "NOT_SERVING")
        cancelled.call.cancel()  # the gateway gives up while the stream is held
        with pytest.raises(grpc.RpcError) as refused:  # never admitted: refused at once, as before
            list(stub.Generate(request("bound-new"), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        ended.thread.join(120)
        assert not ended.thread.is_alive()
        assert ended.error is not None and ended.error.code() == grpc.StatusCode.UNAVAILABLE, ended.error
        assert f"--reattach-timeout {REATTACH_TIMEOUT_S}s" in ended.error.details(), ended.error.details()
        assert len(ended.tokens) < MAX_TOKENS
    finally:
        ledger.client.delete(ledger.k_lease)
    assert "lost the lease" in sched.log_text()[mark:]
    wait_for("the scheduler leading again", lambda: cluster.health(sched.address) == "SERVING")
    # The request the gateway cancelled is aborted by the next lead; the one that ended runs on in the ledger.
    wait_for("the cancelled request aborted",
             lambda: (req := ledger.get_request("bound-cancelled")) is not None and req.finish_reason == "abort")

    assert_idle(ledger)


def assert_idle(ledger) -> None:
    def idle():
        state = ledger.check_ledger()
        return state if state["free"] + state["evictable"] == state["total"] and not state["active"] else None

    state = wait_for("an idle ledger", idle, timeout=120)
    assert state["allocated"] == 0 and state["overlap"] == 0, state


def test_a_held_embed_ends_unavailable_naming_the_bound(stack):
    # The worker is stopped so that the embedding's step waits in it while the lease is taken: its commit is then
    # fenced, the scheduler stands by and holds the call (servers/held_embed.py) until --reattach-timeout.
    sched, stub, ledger, worker = stack
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        call = stub.Embed.future(vpb.EmbedRequest(request_id="bound-embed",
                                                  tokenized=vpb.TokenizedInput(input_ids=PROMPT_IDS)), timeout=300)
        wait_for("the embedding's step sent to the stopped worker",
                 lambda: stub.GetLoads(vpb.GetLoadsRequest(), timeout=30).loads[0].num_running_reqs or call.done())
        ledger.client.set(ledger.k_lease, FOREIGN_LEASE, px=600_000)
        os.kill(worker.pid, signal.SIGCONT)
        error = call.exception(timeout=120)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        ledger.client.delete(ledger.k_lease)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert f"--reattach-timeout {REATTACH_TIMEOUT_S}s" in error.details(), error.details()
    wait_for("the scheduler leading again", lambda: cluster.health(sched.address) == "SERVING")
    assert_idle(ledger)
