"""The asyncio client of llmserve.v1 (the scheduler's public gRPC API), shared by the HTTP API, `llmserve generate`
and the load generator.

A request lives on in Redis when the scheduler in front of it restarts or fails over: a Generate stream that ends
with UNAVAILABLE is re-opened by its request id and replayed from its first token, so the caller sees every token
once and in order, as if the stream had never broken. The replayed tokens are compared with those already seen: a
Redis fail-over that lost the last commits makes the scheduler compute them again, identically for greedy and seeded
sampling, but not for a request whose admission (and drawn seed) was lost; that raises StreamDiverged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import MAX_MESSAGE_BYTES
from common.public_protocol import accepted
from common.tls import open_channel
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc

REATTACH_PAUSE_S = 0.2  # between re-attach attempts while the server answers UNAVAILABLE
# Reconnect quickly to a restarted scheduler (gRPC's default backoff grows to minutes).
CHANNEL_OPTIONS = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000))


class IncompleteStream(Exception):
    """The server ended a Generate stream normally before every sequence had its final message."""


class StreamDiverged(Exception):
    """After a re-attach the server sent a token that differs from one the caller already received."""


def bearer(api_key: str | None) -> list[tuple[str, str]] | None:
    """The call metadata that carries an API key."""
    return [("authorization", f"Bearer {api_key}")] if api_key else None


class Client:
    """A connection to one scheduler address (a load balancer's, or a leader's that a standby takes over). Make it
    inside the event loop that uses it; `close()` (or `async with`) releases the channel."""

    def __init__(self, address: str, *, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
                 reattach_timeout: float = 60.0):
        self.address, self.reattach_timeout = address, reattach_timeout
        self.channel = open_channel(address, credentials, server_name, CHANNEL_OPTIONS, aio=True)
        self.stub = pb_grpc.LLMServeStub(self.channel)
        self.metadata = bearer(api_key)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float) -> None:
        """Wait until the channel connects; ConnectionError after `timeout` seconds."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise ConnectionError(f"cannot reach {self.address} within {timeout:g} s") from None

    def generate(self, req: pb.GenerateRequest, *, reattach_before_start: bool = True,
                 on_unavailable: Callable[[grpc.aio.AioRpcError], None] | None = None) -> Stream:
        """Stream `req` (see Stream). `reattach_before_start` False: UNAVAILABLE before the scheduler accepted the
        request (no worker yet, a draining scheduler) is raised at once for the caller to report rather than waited
        out; once accepted (its headers say so, common/public_protocol.py), also a request still queued re-attaches."""
        return Stream(self, req, reattach_before_start, on_unavailable)

    async def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        """Abort a request by the id it was sent with (the scheduler finds every sequence of n > 1). UNAVAILABLE (a
        scheduler standing by while Redis fails over, a restart) is retried for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                resp = await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata,
                                             timeout=max(0.1, deadline - time.monotonic()))
                return resp.found
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + REATTACH_PAUSE_S >= deadline:
                    raise
            await asyncio.sleep(REATTACH_PAUSE_S)

    async def embed(self, req: pb.EmbedRequest) -> pb.EmbedResponse:
        """One Embed call. UNAVAILABLE before the scheduler accepted the request is raised at once (the caller's
        503); once accepted (a lost lease, a fail-over mid-call) it is sent again under a fresh request id for up
        to `reattach_timeout` seconds: a single reply has no tokens to resume, and the vector is computed anew."""
        deadline, attempt, sent = None, 0, req
        while True:
            call = self.stub.Embed(sent, metadata=self.metadata)
            try:
                return await call
            except grpc.aio.AioRpcError as e:
                # Once accepted, a scheduler standing by (UNAVAILABLE without the header) is waited out too.
                if e.code() != grpc.StatusCode.UNAVAILABLE or (
                        deadline is None and not accepted(await call.initial_metadata())):
                    raise
                deadline = deadline or time.monotonic() + self.reattach_timeout
                if time.monotonic() + REATTACH_PAUSE_S >= deadline:
                    raise
            attempt += 1
            sent = pb.EmbedRequest()
            sent.CopyFrom(req)
            if req.request_id:  # the first id may still be held in Redis by the request the failure interrupted
                sent.request_id = f"{req.request_id}-retry{attempt}"
            await asyncio.sleep(REATTACH_PAUSE_S)

    async def model_info(self, timeout: float = 5.0) -> pb.ModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=timeout)

    async def health(self, timeout: float = 2.0) -> str:
        """The scheduler's gRPC health status name (SERVING, NOT_SERVING), or the status code that prevented one."""
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


@dataclass
class _Seen:
    """What the caller has been given of one sequence: a re-attach resumes from here."""

    tokens: int = 0
    chars: int = 0
    done: bool = False
    ids: list[int] = field(default_factory=list)  # the tokens given, to check a replay against


class Stream:
    """One request's Generate stream across re-attaches: an async iterator of the server's messages, each cut to
    what the caller has not seen yet (token_ids, logprobs and text; first_token_index moved on), and without
    empty ones. Re-attaching needs `req.request_id`; without one UNAVAILABLE is raised like any other error.

    Raises grpc.aio.AioRpcError for a refusal, or for UNAVAILABLE that lasts `reattach_timeout` seconds without
    the server accepting the request again or sending a message; IncompleteStream when the server ends the
    stream early. Leaving it early (`aclose()`, or `async with`) cancels the call, which makes the server abort
    the request."""

    def __init__(self, client: Client, req: pb.GenerateRequest, reattach_before_start: bool,
                 on_unavailable: Callable[[grpc.aio.AioRpcError], None] | None):
        self.client, self.req = client, req
        self.n = max(1, req.sampling.n)
        self.seen = [_Seen() for _ in range(self.n)]
        self.started = False  # the server holds the request: its headers said so, or a message arrived
        self.reattaches = 0  # Generate calls re-opened after UNAVAILABLE
        self._reattach_before_start, self._on_unavailable = reattach_before_start, on_unavailable
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._messages = self._run()

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.seen)

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._messages.aclose()

    def _may_reattach(self, e: grpc.aio.AioRpcError) -> bool:
        return (e.code() == grpc.StatusCode.UNAVAILABLE and bool(self.req.request_id)
                and (self.started or self._reattach_before_start))

    async def _run(self) -> AsyncIterator[pb.GenerateResponse]:
        client, req, seen = self.client, self.req, self.seen
        deadline = None  # while UNAVAILABLE lasts: when to give up
        while not self.finished:
            # Replay from the first token (the server resumes every sequence at one index) and cut off what was
            # seen, after checking that it is what was seen.
            req.resume_from_token = 0
            server_chars = [0] * self.n
            self._call = client.stub.Generate(req, metadata=client.metadata)
            try:
                # Sent on admission, long before the first token of a queued request (empty if refused).
                if accepted(await self._call.initial_metadata()):
                    self.started, deadline = True, None
                async for msg in self._call:
                    self.started, deadline = True, None
                    i, s = msg.index, seen[msg.index]
                    if s.done:
                        continue
                    skip = max(0, s.tokens - msg.first_token_index)
                    replayed = list(msg.token_ids[:skip])
                    if replayed != s.ids[msg.first_token_index:msg.first_token_index + len(replayed)]:
                        raise StreamDiverged(
                            f"request {req.request_id} (sequence {i}) was sent tokens {replayed} at position "
                            f"{msg.first_token_index} after a re-attach, but had received "
                            f"{s.ids[msg.first_token_index:msg.first_token_index + len(replayed)]} there (the server "
                            "lost them and sampled them again)")
                    cut = max(0, s.chars - server_chars[i])
                    server_chars[i] += len(msg.text)
                    if skip:
                        del msg.token_ids[:skip]
                        del msg.logprobs[:skip]
                        msg.first_token_index += skip
                    if cut:
                        msg.text = msg.text[cut:]
                    s.tokens += len(msg.token_ids)
                    s.ids.extend(msg.token_ids)
                    s.chars += len(msg.text)
                    s.done = bool(msg.finish_reason)
                    if msg.token_ids or msg.text or s.done:
                        yield msg
                if not self.finished:
                    raise IncompleteStream(f"the server ended the stream of {req.request_id or 'a request'} "
                                           "before every sequence finished")
            except grpc.aio.AioRpcError as e:
                if not self._may_reattach(e):
                    raise
                if deadline is None:  # the server went away (restart, fail-over): the request lives on in Redis
                    deadline = time.monotonic() + client.reattach_timeout
                    if self._on_unavailable is not None:
                        self._on_unavailable(e)
                if time.monotonic() >= deadline:
                    raise
                self.reattaches += 1
                await asyncio.sleep(REATTACH_PAUSE_S)
            finally:
                if not self._call.done():
                    self._call.cancel()
