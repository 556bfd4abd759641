"""common.client against an in-process gRPC server that breaks its first stream with UNAVAILABLE: the caller sees
every token (and every character) once and in order, for one sequence (resumed at the next token) and for several
(replayed from the start and cut); refusals, early ends and a server that stays away are raised."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.client import Client, IncompleteStream
from common.public_protocol import ACCEPTED_HEADER
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc

TOKENS = list(range(100, 112))


def text(ids) -> str:
    return "".join(f"<{t}>" for t in ids)


class FlakyServer(pb_grpc.LLMServeServicer):
    """Streams TOKENS to every sequence, `chunks[k]` tokens per message in call k (the last size for later calls);
    call k breaks with `breaks[k]` (a status code) after `break_after` messages, or ends early with `end_early`;
    with `accept` each call first says in its headers that it holds the request, as the scheduler does."""

    def __init__(self, chunks=(3, 2), breaks=(grpc.StatusCode.UNAVAILABLE,), break_after=2, end_early=False,
                 accept=False):
        self.chunks, self.breaks, self.break_after, self.end_early = chunks, breaks, break_after, end_early
        self.accept = accept
        self.resumes: list[int] = []

    async def Generate(self, request, context):
        call = len(self.resumes)
        self.resumes.append(request.resume_from_token)
        if self.accept:
            await context.send_initial_metadata(((ACCEPTED_HEADER, "1"),))
        size = self.chunks[min(call, len(self.chunks) - 1)]
        for k, pos in enumerate(range(request.resume_from_token, len(TOKENS), size)):
            if k == self.break_after and call < len(self.breaks):
                await context.abort(self.breaks[call], "the scheduler restarts")
            if k == self.break_after and self.end_early:
                return
            ids = TOKENS[pos:pos + size]
            for i in range(max(1, request.sampling.n)):
                yield pb.GenerateResponse(request_id=request.request_id, index=i, token_ids=ids, text=text(ids),
                                          first_token_index=pos,
                                          finish_reason="length" if pos + size >= len(TOKENS) else "")

    async def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id == "r")


def collect(server: FlakyServer, n: int = 1, request_id: str = "r", **kw):
    async def run():
        grpc_server = grpc.aio.server()
        pb_grpc.add_LLMServeServicer_to_server(server, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        got = {i: {"ids": [], "text": "", "first": [], "finish": ""} for i in range(n)}
        try:
            async with Client(f"127.0.0.1:{port}", reattach_timeout=kw.pop("timeout", 30)) as client:
                req = pb.GenerateRequest(request_id=request_id, text="hi", sampling=pb.SamplingParams(n=n))
                async with client.generate(req, **kw) as messages:
                    async for msg in messages:
                        g = got[msg.index]
                        g["first"].append(msg.first_token_index)
                        assert msg.first_token_index == len(g["ids"])
                        g["ids"] += msg.token_ids
                        g["text"] += msg.text
                        g["finish"] = msg.finish_reason or g["finish"]
                return got, messages.reattaches, await client.abort("r")
        finally:
            await grpc_server.stop(None)

    return asyncio.run(run())


@pytest.mark.parametrize("n", [1, 3])
def test_a_broken_stream_is_resumed_and_each_token_is_seen_once(n):
    server = FlakyServer()
    got, reattaches, aborted = collect(server, n)
    assert reattaches == 1 and aborted
    # Re-attached streams replay from 0 (what was seen is checked, then cut off).
    assert server.resumes == [0, 0]
    for i in range(n):
        assert got[i] == {**got[i], "ids": TOKENS, "text": text(TOKENS), "finish": "length"}


def test_refusals_and_early_ends_are_raised():
    with pytest.raises(grpc.aio.AioRpcError) as e:
        collect(FlakyServer(breaks=(grpc.StatusCode.INVALID_ARGUMENT,), break_after=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Before the first message, UNAVAILABLE is the caller's when it asks (the HTTP API answers 503 at once).
    with pytest.raises(grpc.aio.AioRpcError) as e:
        collect(FlakyServer(break_after=0), reattach_before_start=False)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Without a request id there is nothing to re-attach to.
    with pytest.raises(grpc.aio.AioRpcError):
        collect(FlakyServer(), request_id="")
    with pytest.raises(IncompleteStream):
        collect(FlakyServer(breaks=(), end_early=True))


def test_an_accepted_request_re_attaches_before_its_first_token():
    """A queued request (accepted, no token yet) whose scheduler steps down re-attaches, also for a caller that
    reports UNAVAILABLE before acceptance at once (the HTTP API): the request lives on in Redis."""
    server = FlakyServer(break_after=0, accept=True)
    got, reattaches, _ = collect(server, reattach_before_start=False)
    assert reattaches == 1 and server.resumes == [0, 0]
    assert got[0] == {**got[0], "ids": TOKENS, "text": text(TOKENS), "finish": "length"}
    # A refusal after acceptance is still the caller's.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        collect(FlakyServer(breaks=(grpc.StatusCode.DEADLINE_EXCEEDED,), break_after=0, accept=True),
                reattach_before_start=False)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_server_that_stays_unavailable_ends_the_stream():
    server = FlakyServer(breaks=(grpc.StatusCode.UNAVAILABLE,) * 1000, break_after=0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        collect(server, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and len(server.resumes) >= 2


class StandbyServer(pb_grpc.LLMServeServicer):
    """Answers Abort UNAVAILABLE `standby_calls` times (a scheduler standing by while Redis fails over), then leads."""

    def __init__(self, standby_calls: int):
        self.standby_calls, self.calls = standby_calls, 0

    async def Abort(self, request, context):
        self.calls += 1
        if self.calls <= self.standby_calls:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler does not lead the pool right now")
        return pb.AbortResponse(found=True)


def abort_on(server: StandbyServer, timeout: float) -> bool:
    async def run():
        grpc_server = grpc.aio.server()
        pb_grpc.add_LLMServeServicer_to_server(server, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        try:
            async with Client(f"127.0.0.1:{port}") as client:
                return await client.abort("r", timeout=timeout)
        finally:
            await grpc_server.stop(None)

    return asyncio.run(run())


def test_abort_retries_a_standby_scheduler_until_it_leads():
    server = StandbyServer(standby_calls=3)
    assert abort_on(server, timeout=30) and server.calls == 4
    # One that stays a standby: UNAVAILABLE once the timeout has passed.
    server = StandbyServer(standby_calls=10 ** 6)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        abort_on(server, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and server.calls >= 2
