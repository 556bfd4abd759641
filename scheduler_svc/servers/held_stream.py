"""An admitted request's stream kept open across a stand-down of this scheduler, for clients that cannot re-attach.

llmserve.v1 ends a stream UNAVAILABLE when its scheduler stops leading (a lost lease, Redis failing over) and its
client re-attaches by request id (common/client.py). A gateway speaking vLLM's engine protocol (smg) knows no such
thing: it would lose the request. So its handler waits here until this scheduler leads the pool again, admits the
same request again (found in the Redis ledger, or submitted anew if its admission never reached Redis), replays it
from the first token and passes on only what it had not sent yet, after checking that the replay matches.
Past --reattach-timeout without leading again the stream ends UNAVAILABLE, naming the setting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from protos import llmserve_pb2 as pb
from scheduler_svc.driver.admission import AdmissionError
from scheduler_svc.driver.frontend import SubmitError
from scheduler_svc.servers.sequence_stream import SequenceStream
from scheduler_svc.servers.servicer import HandedOver, refusal_status
from scheduler_svc.servers.store_errors import store_unavailable

if TYPE_CHECKING:
    from scheduler_svc.servers.servicer import LLMServeServicer

LEADING_POLL_S = 0.1  # how often a held stream looks whether this scheduler leads again


class Diverged(Exception):
    """The replay after a stand-down differs from tokens already sent (a seeded request whose admission Redis
    lost drew another seed)."""


class Replay:
    """What each sequence has been sent: the pure part, cutting a replayed message down to what is new."""

    def __init__(self, n: int):
        self.sent: list[list[int]] = [[] for _ in range(n)]
        self.done = [False] * n
        self.prompt_sent = False  # prompt logprobs go out once

    def cut(self, msg: pb.GenerateResponse) -> pb.GenerateResponse | None:
        """`msg` without what was sent before (None if nothing is left); Diverged if the replay differs."""
        i = msg.index
        if self.done[i]:
            return None
        sent, start = self.sent[i], msg.first_token_index
        skip = max(0, len(sent) - start)
        replayed = list(msg.token_ids[:skip])
        if replayed != sent[start:start + len(replayed)]:
            raise Diverged(f"sequence {i} was sent tokens {sent[start:start + len(replayed)]} at position {start} "
                           f"before this scheduler stood down, and its replay has {replayed} there")
        if skip:
            del msg.token_ids[:skip]
            del msg.logprobs[:skip]
            msg.first_token_index += skip
        if msg.prompt_token_ids:
            if self.prompt_sent:
                msg.ClearField("prompt_token_ids")
                msg.ClearField("prompt_logprobs")
            self.prompt_sent = True
        sent.extend(msg.token_ids)
        self.done[i] = bool(msg.finish_reason)
        return msg if msg.token_ids or msg.finish_reason or msg.prompt_token_ids else None


class HeldStream:
    """The messages of one admitted request, each sequence's tokens once and in order, across stand-downs.
    `streams` are the sequences' current SequenceStreams (their stop-string state, their request)."""

    def __init__(self, public: LLMServeServicer, request: pb.GenerateRequest, rid: str,
                 streams: list[SequenceStream], context, rename: Callable[[str], str]):
        self.public, self.driver = public, public.driver
        self.request, self.rid, self.streams = request, rid, streams
        self.context, self.rename = context, rename
        self.replay = Replay(len(streams))

    async def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        while True:
            try:
                async for msg in self.public.stream(self.rid, self.streams, self.context):
                    try:
                        out = self.replay.cut(msg)
                    except Diverged as e:
                        await self.context.abort(grpc.StatusCode.DATA_LOSS, f"request {self.rid}: {e}")
                    if out is not None:
                        yield out
                return
            except HandedOver:
                pass  # held: the request lives on in Redis
            self.streams = await self._admit_again()

    async def _admit_again(self) -> list[SequenceStream]:
        again = pb.GenerateRequest()
        again.CopyFrom(self.request)
        again.resume_from_token = 0  # every sequence from its first token: Replay cuts what was sent
        return await admit_when_leading(self.public, again, self.context, self.rename,
                                        [s.pub.request.request_id for s in self.streams])


async def admit_when_leading(public: LLMServeServicer, again: pb.GenerateRequest, context,
                             rename: Callable[[str], str], ids: list[str], embed: bool = False) -> list[SequenceStream]:
    """Wait until this scheduler leads again and admit `again` (the request it stood down with, whose sequences
    were `ids`), or end the call UNAVAILABLE past --reattach-timeout. A client that leaves meanwhile has those
    sequences aborted, now or by the next lead."""
    driver, timeout = public.driver, public.driver.cfg.reattach_timeout
    deadline = time.monotonic() + timeout
    rid = again.request_id
    try:
        while time.monotonic() < deadline:
            if driver.stopping.is_set() or driver.draining.is_set():
                await context.abort(grpc.StatusCode.UNAVAILABLE, (
                    f"this scheduler is shutting down; request {rid} lives on in the Redis ledger: send it "
                    "again by the same request_id to the scheduler that leads next"))
            if driver.ready.is_set():
                try:
                    _, streams = await public.admit_or_raise(again, context, embed)
                    return streams
                except SubmitError as e:
                    if e.code != "UNAVAILABLE":
                        await context.abort(*refusal_status(e))
                except AdmissionError as e:
                    await context.abort(*refusal_status(e, rename))
                except Exception as e:
                    if not store_unavailable(e):
                        raise
            await asyncio.sleep(LEADING_POLL_S)
    except asyncio.CancelledError:  # the client left while held: the request must not run on for no one
        for seq_id in ids:
            if not driver.abort(seq_id):
                driver.abort_at_next_lead(seq_id)
        raise
    await context.abort(grpc.StatusCode.UNAVAILABLE, (
        f"this scheduler stood down (lost its lease, or Redis is failing over) and did not lead again within "
        f"--reattach-timeout {timeout:g}s; request {rid} lives on in the Redis ledger: send it again by the "
        "same request_id"))
