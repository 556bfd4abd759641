"""Real Redis failures (a stopped, a killed and a read-only redis-server) as the public servers and the HTTP API's
Responses store see them: the one mapping (scheduler_svc/servers/store_errors.py) turns each into gRPC UNAVAILABLE
through a real grpc.aio server, the Responses store into a 503 with Retry-After; other errors stay what they are."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from api_svc.errors import APIError
from api_svc.responses.store import ResponseStore
from llmserve.processes import start_redis, stop
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.ledger.store import RedisLedger
from scheduler_svc.servers.store_errors import retryable_store_errors, store_unavailable

FAST = "?socket_timeout=0.3&socket_connect_timeout=0.3"


@pytest.fixture
def node(tmp_path):
    proc = start_redis(str(tmp_path / "redis"))
    yield proc
    if proc.alive():
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc, timeout=5)


def failure_of(call) -> BaseException:
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("the call did not fail")


def test_real_redis_failures_are_unavailable(node, tmp_path):
    ledger = RedisLedger(redis.Redis.from_url(node.url + FAST), namespace="t")
    ledger.init_pool(num_blocks=4, block_size=4)
    os.kill(node.pid, signal.SIGSTOP)
    stopped = failure_of(lambda: ledger.get_request("r"))
    os.kill(node.pid, signal.SIGCONT)
    assert isinstance(stopped, redis.TimeoutError) and store_unavailable(stopped)
    replica = start_redis(str(tmp_path / "replica"), extra_args=["--replicaof", "127.0.0.1", node.port])
    try:
        read_only = failure_of(lambda: redis.Redis(port=replica.port).set("k", "v"))
        assert isinstance(read_only, redis.ReadOnlyError) and store_unavailable(read_only)
    finally:
        stop(replica, timeout=5)
    no_master = failure_of(lambda: Sentinel([("127.0.0.1", node.port)], socket_timeout=0.3)
                           .discover_master("nobody"))
    assert isinstance(no_master, MasterNotFoundError) and store_unavailable(no_master)
    stop(node, timeout=5)
    gone = failure_of(lambda: ledger.get_request("r"))
    assert isinstance(gone, redis.ConnectionError) and store_unavailable(gone)
    assert not store_unavailable(redis.ResponseError("ERR wrong number of arguments"))
    assert not store_unavailable(KeyError("r"))


class LedgerServicer(pb_grpc.LLMServeServicer):
    """Handlers that read a ledger, as the scheduler's Generate (a stream) and Abort (unary) do."""

    def __init__(self, ledger: RedisLedger):
        self.ledger = ledger

    @retryable_store_errors
    async def Generate(self, request, context):
        req = self.ledger.get_request(request.request_id)
        yield pb.GenerateResponse(request_id=request.request_id, finish_reason="" if req is None else "length")

    @retryable_store_errors
    async def Abort(self, request, context):
        if request.request_id == "bug":
            raise KeyError("a bug, not an outage")
        return pb.AbortResponse(found=self.ledger.get_request(request.request_id) is not None)


def test_a_stopped_redis_reaches_grpc_clients_as_unavailable_then_the_call_succeeds(node):
    ledger = RedisLedger(redis.Redis.from_url(node.url + FAST), namespace="t")

    async def run():
        server = grpc.aio.server()
        pb_grpc.add_LLMServeServicer_to_server(LedgerServicer(ledger), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.LLMServeStub(ch)
                os.kill(node.pid, signal.SIGSTOP)
                try:
                    codes = []
                    for call in (lambda: stub.Abort(pb.AbortRequest(request_id="r"), timeout=60),
                                 lambda: _first(stub.Generate(pb.GenerateRequest(request_id="r"), timeout=60))):
                        try:
                            await call()
                        except grpc.aio.AioRpcError as e:
                            codes.append((e.code(), e.details()))
                finally:
                    os.kill(node.pid, signal.SIGCONT)
                assert [c for c, _ in codes] == [grpc.StatusCode.UNAVAILABLE] * 2, codes
                assert all("Redis ledger" in d and "retry" in d for _, d in codes), codes
                assert (await stub.Abort(pb.AbortRequest(request_id="r"), timeout=60)).found is False
                assert (await _first(stub.Generate(pb.GenerateRequest(request_id="r"), timeout=60))).request_id == "r"
                with pytest.raises(grpc.aio.AioRpcError) as bug:
                    await stub.Abort(pb.AbortRequest(request_id="bug"), timeout=60)
                assert bug.value.code() == grpc.StatusCode.UNKNOWN  # not an outage: not hidden as one
        finally:
            await server.stop(None)

    asyncio.run(run())


async def _first(call):
    async for msg in call:
        return msg


def test_the_responses_store_answers_503_with_retry_after_while_redis_is_stopped(node):
    async def run():
        store = ResponseStore(node.url + FAST, "t", ttl_s=60)
        try:
            await store.put("resp_1", {"response": {"status": "completed"}, "messages": []})
            os.kill(node.pid, signal.SIGSTOP)
            try:
                errors = []
                for call in (store.get("resp_1"), store.delete("resp_1"), store.cancel("resp_1"),
                             store.put("resp_2", {"response": {"status": "in_progress"}, "messages": []})):
                    with pytest.raises(APIError) as e:
                        await call
                    errors.append(e.value)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert all(e.status == 503 and e.headers == {"Retry-After": "1"} for e in errors), errors
            assert (await store.get("resp_1"))["response"]["status"] == "completed"  # nothing lost
        finally:
            await store.close()

    asyncio.run(run())
