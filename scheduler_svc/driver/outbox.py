"""What clients may see: per request, the committed tokens and the finish reason, behind one lock; and the bridge
from the driver thread to the public API's event loop.

The driver publishes a step here only after its Redis commit. One publish hands the loop the ids of the requests that
got news, once (`loop.call_soon_threadsafe`); there, only the streams watching those ids are woken. Streams then
read what is new under the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler_svc.core.prompt_results import complete_prompt_logprobs
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import Logprobs, SampledToken

_MAX_FINISHED_KEPT = 10_000
UNAVAILABLE = "unavailable"  # this process stopped serving the request: the client re-attaches elsewhere


@dataclass
class Published:
    """What clients may see of one request: committed tokens only."""

    request: Request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""  # why the request failed, for a finish reason that ends the stream with an error status
    # Set once, from the committed step that gave the first token (scheduler_svc/core/prompt_results.py).
    prompt_logprobs: list[Logprobs | None] | None = None
    embedding: list[float] | None = None  # an embed request's vector, with its finish

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Its first message must carry the prompt logprobs, which have not come yet (a sibling of n > 1 shares
        the first sequence's prompt and never scores it)."""
        req = self.request
        return (req.sampling.prompt_logprobs is not None and self.prompt_logprobs is None and not req.fork_of
                and self.finish_reason is None)

    @classmethod
    def of_stored(cls, req: Request, finished: bool) -> Published:
        """A request read back from Redis, with its stored logprobs (None where none are stored)."""
        n, stored = len(req.output_ids), req.output_logprobs or []
        return cls(req, list(req.output_ids), list(stored[:n]) + [None] * (n - len(stored)),
                   req.finish_reason if finished else None)


class Watch:
    """One stream's doorbell on the event loop: set when a request it follows got news."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.event = asyncio.Event()
        self.wakes = 0  # how many publishes woke this stream (tests count them)

    def ring(self) -> None:
        self.wakes += 1
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class Outbox:
    def __init__(self):
        self.lock = threading.Lock()
        self.published: OrderedDict[str, Published] = OrderedDict()
        self.loop: asyncio.AbstractEventLoop | None = None  # the public API's loop, once it runs
        self._watches: dict[str, set[Watch]] = {}  # touched on the loop only

    def get(self, rid: str) -> Published | None:
        with self.lock:
            return self.published.get(rid)

    def unfinished_ids(self) -> list[str]:
        with self.lock:
            return [rid for rid, p in self.published.items() if p.finish_reason is None]

    # ---- the event loop's side -------------------------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop

    def watch(self, request_ids: list[str]) -> Watch:
        """Register a stream (on the loop) before it reads, so that no publish after the read is missed."""
        w = Watch(request_ids)
        for rid in request_ids:
            self._watches.setdefault(rid, set()).add(w)
        return w

    def unwatch(self, w: Watch) -> None:
        for rid in w.request_ids:
            ws = self._watches.get(rid)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._watches[rid]

    def _ring(self, request_ids: Iterable[str] | None) -> None:
        """On the loop: wake the streams of `request_ids` (None: every stream)."""
        if request_ids is None:
            request_ids = self._watches
        # Once per stream, even when several of its sequences (n > 1) got news in this step.
        for w in {w for rid in request_ids for w in self._watches.get(rid, ())}:
            w.ring()

    def _hand_to_loop(self, request_ids: Iterable[str] | None) -> None:
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no stream is left to wake
                loop.call_soon_threadsafe(self._ring, request_ids)

    # ---- the driver thread's side ----------------------------------------------------------------------------

    def publish(self, appended: list[tuple[Request, list[SampledToken]]], finished: list[Request]) -> None:
        news: list[str] = []
        with self.lock:
            for req, toks in appended:
                pub = self.published.get(req.request_id)
                if pub is not None:
                    if pub.prompt_logprobs is None and req.sampling.prompt_logprobs is not None:
                        pub.prompt_logprobs = complete_prompt_logprobs(req)
                    pub.token_ids.extend(t.token_id for t in toks)
                    pub.logprobs.extend(t.logprobs for t in toks)
                    news.append(req.request_id)
            for req in finished:
                pub = self.published.get(req.request_id)
                if pub is not None:
                    pub.finish_reason = req.finish_reason
                    pub.embedding = req.embedding
                    pub.error = req.error
                    self.published.move_to_end(req.request_id)
                    news.append(req.request_id)
            while len(self.published) > _MAX_FINISHED_KEPT and next(iter(self.published.values())).finish_reason:
                self.published.popitem(last=False)
        if news:
            self._hand_to_loop(news)

    def end_all(self) -> list[Request]:
        """This process stops serving: every open stream ends (clients re-attach to the next leader by request id).
        Returns the requests that were still unfinished."""
        with self.lock:
            left = [p.request for p in self.published.values() if p.finish_reason is None]
            for pub in self.published.values():
                if pub.finish_reason is None:
                    pub.finish_reason = UNAVAILABLE
            self.published.clear()
        self._hand_to_loop(None)
        return left
