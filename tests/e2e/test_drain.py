"""Graceful drain on SIGTERM (`--shutdown-timeout`): NOT_SERVING and no admission at once, in-flight requests
finish, what is still running at the deadline is aborted with finish_reason "abort", exit code 0."""

import signal
import threading

import grpc
import pytest

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster


@pytest.fixture(scope="module")
def worker():
    w = cluster.start_worker(["--num-gpu-blocks-override", "128", "--max-model-len", "1024"])
    yield w
    cluster.stop_all()


def stream(stub, rid: str, max_tokens: int, out: dict) -> None:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5, 6, 7, 8]),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    try:
        for msg in stub.Generate(req, timeout=120):
            tokens.extend(msg.token_ids)
            if msg.finish_reason:
                out[rid] = (tokens, msg.finish_reason)
    except grpc.RpcError as e:
        out[rid] = (tokens, e.code())


@pytest.mark.parametrize("timeout_s,max_tokens,expect", [(60, 24, "length"), (1, 600, "abort")])
def test_sigterm_drains_in_flight_requests(redis_server, worker, timeout_s, max_tokens, expect):  # noqa: F811
    sched = cluster.start_scheduler(redis_server, worker, ["--shutdown-timeout", str(timeout_s)])
    try:
        cluster.wait_healthy(sched.address)
        stub = pb_grpc.LLMServeStub(grpc.insecure_channel(sched.address))
        out: dict = {}
        t = threading.Thread(target=stream, args=(stub, "drain-a", max_tokens, out))
        t.start()
        ledger = cluster.ledger(redis_server, sched.namespace)
        while not getattr(ledger.get_request("drain-a"), "output_ids", None):
            t.join(0.05)  # until the first token is committed
        sched.popen.send_signal(signal.SIGTERM)
        cluster_health = None
        for _ in range(100):
            cluster_health = cluster.health(sched.address)
            if cluster_health != "SERVING":
                break
            t.join(0.05)
        assert cluster_health in ("NOT_SERVING", "UNAVAILABLE")
        if sched.alive() and expect == "length":
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                   timeout=30))
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(120)
        tokens, finish = out["drain-a"]
        assert finish == expect
        if expect == "length":
            assert len(tokens) == max_tokens
        else:
            assert 0 < len(tokens) < max_tokens
        assert sched.popen.wait(timeout=30) == 0
    finally:
        cluster.stop(sched)
    state = cluster.ledger(redis_server, sched.namespace).check_ledger()
    assert state["allocated"] == 0 and state["active"] == 0, state
