"""common.client checks a replay: after a re-attach the server sends every sequence again from token 0, and a token
that differs from one the caller already received raises StreamDiverged instead of being accepted (a Redis
fail-over that lost a request's admission samples it again with another seed); identical replays are cut off."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.client import Client, StreamDiverged
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc

FIRST = [10, 11, 12, 13, 14, 15]


class ReplayServer(pb_grpc.LLMServeServicer):
    """Call 0 streams FIRST[:4] and breaks with UNAVAILABLE; later calls stream `replay` from `resume_from_token`."""

    def __init__(self, replay: list[int]):
        self.replay, self.calls = replay, []

    async def Generate(self, request, context):
        self.calls.append(request.resume_from_token)
        if len(self.calls) == 1:
            for pos in (0, 2):
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=FIRST[pos:pos + 2],
                                          first_token_index=pos)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fail-over")
        ids = self.replay[request.resume_from_token:]
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=ids,
                                  first_token_index=request.resume_from_token, finish_reason="length")


def collect(server: ReplayServer) -> list[int]:
    async def run():
        grpc_server = grpc.aio.server()
        pb_grpc.add_LLMServeServicer_to_server(server, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        try:
            async with Client(f"127.0.0.1:{port}", reattach_timeout=30) as client:
                got = []
                async for msg in client.generate(pb.GenerateRequest(request_id="r", text="hi")):
                    assert msg.first_token_index == len(got)
                    got += msg.token_ids
                return got
        finally:
            await grpc_server.stop(None)

    return asyncio.run(run())


def test_an_identical_replay_is_cut_and_the_stream_goes_on():
    server = ReplayServer(FIRST)
    assert collect(server) == FIRST
    assert server.calls == [0, 0]


def test_a_replay_that_changes_a_seen_token_raises():
    changed = [*FIRST[:3], 99, *FIRST[4:]]
    with pytest.raises(StreamDiverged, match=r"sent tokens \[10, 11, 12, 99\] at position 0"):
        collect(ReplayServer(changed))
    assert collect(ReplayServer([*FIRST[:4], 77, 78])) == [*FIRST[:4], 77, 78]  # only unseen tokens changed
