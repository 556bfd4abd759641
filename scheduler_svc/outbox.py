"""What clients may see: per request, the committed tokens and the finish reason, behind one lock and condition.

The driver publishes a step here only after its Redis commit; gRPC stream handlers wait on `changed` and read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler_svc.outputs import Logprobs, SampledToken
from scheduler_svc.request import Request

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

    @classmethod
    def of_stored(cls, req: Request, finished: bool) -> Published:
        """A request read back from Redis (its logprobs are not stored)."""
        return cls(req, list(req.output_ids), [None] * len(req.output_ids),
                   req.finish_reason if finished else None)


class Outbox:
    def __init__(self):
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified after each published step
        self.published: OrderedDict[str, Published] = OrderedDict()

    def get(self, rid: str) -> Published | None:
        with self.lock:
            return self.published.get(rid)

    def unfinished_ids(self) -> list[str]:
        with self.lock:
            return [rid for rid, p in self.published.items() if p.finish_reason is None]

    def publish(self, appended: list[tuple[Request, list[SampledToken]]], finished: list[Request]) -> None:
        with self.lock:
            for req, toks in appended:
                pub = self.published.get(req.request_id)
                if pub is not None:
                    pub.token_ids.extend(t.token_id for t in toks)
                    pub.logprobs.extend(t.logprobs for t in toks)
            for req in finished:
                pub = self.published.get(req.request_id)
                if pub is not None:
                    pub.finish_reason = req.finish_reason
                    pub.error = req.error
                    self.published.move_to_end(req.request_id)
            while len(self.published) > _MAX_FINISHED_KEPT and next(iter(self.published.values())).finish_reason:
                self.published.popitem(last=False)
            self.changed.notify_all()

    def end_all(self) -> list[Request]:
        """This process stops serving: every open stream ends (clients re-attach to the next leader by request id).
        Returns the requests that were still unfinished."""
        with self.lock:
            left = [p.request for p in self.published.values() if p.finish_reason is None]
            for pub in self.published.values():
                if pub.finish_reason is None:
                    pub.finish_reason = UNAVAILABLE
            self.published.clear()
            self.changed.notify_all()
        return left
