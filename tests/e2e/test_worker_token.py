"""--worker-token: the worker refuses calls without the shared token (health exempt); the scheduler sends it."""

import time

import grpc
import pytest

from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.support import cluster

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def worker():
    w = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                              "--worker-token", TOKEN])
    yield w
    cluster.stop_all()


def describe(address: str, metadata=None) -> wpb.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        return wpb_grpc.WorkerStub(ch).Describe(wpb.DescribeRequest(), timeout=10, metadata=metadata)


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]])
def test_worker_refuses_calls_without_the_token(worker, metadata):
    with pytest.raises(grpc.RpcError) as err:
        describe(worker.address, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--worker-token" in err.value.details()
    with grpc.insecure_channel(worker.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            wpb_grpc.WorkerStub(ch).ExecuteStep(wpb.StepPlan(step_id=1), timeout=10, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health checks need no token (container and launcher probes).
    assert cluster.health(worker.address) == "SERVING"


def test_worker_accepts_the_token(worker):
    assert describe(worker.address, [("authorization", f"Bearer {TOKEN}")]).num_blocks == 64


def test_scheduler_with_the_wrong_token_stays_not_serving(redis_server, worker):  # noqa: F811
    s = cluster.start_scheduler(redis_server, worker, ["--worker-token", "wrong"])
    try:
        time.sleep(3)
        assert s.alive()
        assert cluster.health(s.address) == "NOT_SERVING"
        assert "UNAUTHENTICATED" in s.log_text()
    finally:
        cluster.stop(s)


def test_scheduler_with_the_right_token_serves(redis_server, worker):  # noqa: F811
    from protos import llmserve_pb2 as pb
    from protos import llmserve_pb2_grpc as pb_grpc

    s = cluster.start_scheduler(redis_server, worker, ["--worker-token", TOKEN])
    try:
        cluster.wait_healthy(s.address, proc=s)
        with grpc.insecure_channel(s.address) as ch:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4]),
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            tokens = [t for msg in pb_grpc.LLMServeStub(ch).Generate(req, timeout=120) for t in msg.token_ids]
        assert len(tokens) == 4
    finally:
        cluster.stop(s)
