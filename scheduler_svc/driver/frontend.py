"""The scheduler's thread-facing side: what gRPC handlers call (submit, abort, lookup, drain) and see (the outbox).

Handlers only append typed commands to the inbox and read the outbox, under one lock; the driver thread
(`driver.py`) takes the commands at each iteration boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.core.request import FINISH_ABORT, Request
from scheduler_svc.driver.outbox import Outbox, Published


# Inbox commands, from gRPC threads to the driver thread.
@dataclass
class AddRequest:
    seqs: list[Request]  # the n sequences of one request


@dataclass
class AbortRequest:
    request_id: str
    reason: str


class SubmitError(Exception):
    """A request this scheduler cannot take now; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Frontend:
    """State shared with the driver thread: the inbox, the outbox and the readiness flags. What it needs from the
    driver comes in as arguments: the queue cap, the look-up of a stored request, the size of the waiting queue and
    whether this scheduler still holds the lease."""

    def __init__(self, max_num_queued_requests: int, stored_request: Callable[[str], Request | None],
                 num_waiting: Callable[[], int], leading: Callable[[], bool]):
        self.max_num_queued_requests = max_num_queued_requests
        self._stored_request = stored_request
        self._num_waiting = num_waiting
        self._leading = leading
        self.outbox = Outbox()
        self.lock = self.outbox.lock
        self.inbox: list[AddRequest | AbortRequest] = []
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.ready = threading.Event()  # leader with a live worker
        self.draining = threading.Event()  # shutting down: no new requests
        self.fatal: str | None = None  # settings that cannot work with this worker (the process exits)
        self.on_ready_change = lambda ready: None

    def drain(self, timeout: float) -> int:
        """Stop admitting; let requests in flight finish for up to `timeout` seconds, then abort the rest.
        Returns how many were aborted. With timeout 0 nothing is aborted: the requests stay in Redis and the next
        leader resumes them (clients re-attach by request id)."""
        self.draining.set()
        self.on_ready_change(False)
        if timeout <= 0:
            return 0
        deadline = time.monotonic() + timeout
        while self.outbox.unfinished_ids() and time.monotonic() < deadline and self._leading():
            time.sleep(0.1)
        left = self.outbox.unfinished_ids()
        for rid in left:
            self.abort(rid, FINISH_ABORT)
        end = time.monotonic() + 10
        while self.outbox.unfinished_ids() and time.monotonic() < end and self._leading():
            time.sleep(0.05)  # the aborts are committed at the next iteration boundary
        return len(left)

    def lookup(self, rid: str) -> Published | None:
        pub = self.outbox.get(rid)
        if pub is not None or not self.ready.is_set():
            return pub
        # Not in memory: a request finished before this scheduler started (kept in Redis for a while).
        req = self._stored_request(rid)
        if req is None:
            return None
        with self.lock:
            return self.outbox.published.setdefault(rid, Published.of_stored(req, req.finished))

    def submit(self, seqs: list[Request]) -> list[Published]:
        """Queue the sequences of one request (n > 1: siblings fork from the first), or return the existing ones."""
        with self.lock:
            if self.draining.is_set():
                raise SubmitError("UNAVAILABLE", "this scheduler is shutting down (draining); retry on another "
                                  "scheduler or after the restart")
            if not self.ready.is_set():
                raise SubmitError("UNAVAILABLE", "no worker is registered with this scheduler yet (or it is a "
                                  "standby); retry shortly")
            published = self.outbox.published
            if seqs[0].request_id in published:
                return [published[r.request_id] for r in seqs if r.request_id in published]
            queued = self._num_waiting() + sum(isinstance(c, AddRequest) for c in self.inbox)
            if queued >= self.max_num_queued_requests:
                raise SubmitError("RESOURCE_EXHAUSTED", f"the waiting queue is full: {queued} requests queued, "
                                  f"--max-num-queued-requests is {self.max_num_queued_requests}")
            pubs = [Published(req) for req in seqs]
            for pub in pubs:
                published[pub.request.request_id] = pub
            self.inbox.append(AddRequest(seqs))
        self.wake.set()
        return pubs

    def abort_at_next_lead(self, rid: str, reason: str = FINISH_ABORT) -> None:
        """Abort a request this scheduler does not hold now (it stands by): its next lead applies the abort to the
        request it resumes from Redis, if Redis holds it."""
        with self.lock:
            self.inbox.append(AbortRequest(rid, reason))
        self.wake.set()

    def abort(self, rid: str, reason: str = FINISH_ABORT) -> bool:
        with self.lock:
            pub = self.outbox.published.get(rid)
            if pub is None or pub.finish_reason is not None:
                return pub is not None
            self.inbox.append(AbortRequest(rid, reason))
        self.wake.set()
        return True
