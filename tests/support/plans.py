"""Worker plans for tests, written by request id: a test's stand-in for the scheduler's edge.

Tests name requests by id, as the scheduler's core does; `Wire` turns such entries into a v2 plan (slots from the
real `SlotTable`, cached entries packed) and reads a result's packed arrays back as tokens by id, freeing the slots
of finished requests, as `scheduler_svc.driver.worker_client` does. Cases about malformed slots build plans directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from common.worker_protocol import MAX_SLOTS
from protos import worker_pb2 as pb
from scheduler_svc.core.slot_table import SlotTable

UNKNOWN_SLOT = MAX_SLOTS - 1  # where a test addresses a request the edge never gave a slot


@dataclass
class Cached:
    """A cached entry by request id (v1's CachedRequest)."""

    request_id: str
    num_scheduled_tokens: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_draft_slots: int = 0  # speculative decoding: draft positions the worker may verify after the chunk


@dataclass
class Token:
    request_id: str
    token_id: int
    finish_reason: int = 0
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def add_cached(plan: pb.StepPlan, entries: Iterable[tuple[int, Cached]]) -> None:
    """Append (slot, entry) pairs to the plan's packed cached arrays (num_new_blocks always written)."""
    c = plan.cached
    entries = list(entries)
    if any(e.num_draft_slots for _, e in entries):
        c.num_draft_slots.extend(e.num_draft_slots for _, e in entries)
    for slot, e in entries:
        c.slots.append(slot)
        c.num_scheduled_tokens.append(e.num_scheduled_tokens)
        c.num_new_blocks.append(len(e.new_block_ids))
        c.new_block_ids.extend(e.new_block_ids)
        if e.block_table:
            plan.replaced_tables.add(slot=slot, block_ids=e.block_table)


class Wire:
    def __init__(self):
        self.slots = SlotTable(MAX_SLOTS)
        self.owners: dict[int, list[str | None]] = {}  # step id -> the slot table as that plan saw it

    def slot(self, request_id: str) -> int:
        return self.slots.slot_of.get(request_id, UNKNOWN_SLOT)

    def plan(self, *, new_requests: Iterable[pb.NewRequest] = (), resumed_requests: Iterable[pb.ResumedRequest] = (),
             cached_requests: Iterable[Cached] = (), dropped_request_ids: Iterable[str] = (),
             reset_batch: bool = False, **fields) -> pb.StepPlan:
        if reset_batch:
            self.slots.clear()
        plan = pb.StepPlan(reset_batch=reset_batch, **fields)
        plan.dropped_slots.extend(s for s in map(self.slots.leave, dropped_request_ids) if s is not None)
        for r in new_requests:
            plan.new_requests.append(r)
            plan.new_requests[-1].slot = self._join(r.request_id)
        for r in resumed_requests:
            plan.resumed_requests.append(r)
            plan.resumed_requests[-1].slot = self._join(r.request_id)
        add_cached(plan, ((self.slot(e.request_id), e) for e in cached_requests))
        self.owners[plan.step_id] = self.slots.snapshot()
        return plan

    def _join(self, request_id: str) -> int:
        """A new slot; a request still holding one keeps it (then the worker refuses the entry: drop it first)."""
        return self.slots.slot_of[request_id] if request_id in self.slots.slot_of else self.slots.join(request_id)

    def tokens(self, result: pb.StepResult, *, release: bool = True) -> list[Token]:
        """The result's tokens by request id; the worker forgot the finished ones, so their slots are freed."""
        owners = self.owners.get(result.step_id, self.slots.owner)
        reasons = list(result.finish_reasons) or [0] * len(result.slots)
        out = [Token(owners[s], t, f) for s, t, f in zip(result.slots, result.token_ids, reasons, strict=True)]
        at = 0
        for i, lp, n in zip(result.logprob_indices, result.logprobs, result.num_top_logprobs, strict=True):
            out[i].logprob = lp
            out[i].top_logprobs = list(zip(result.top_logprob_token_ids[at: at + n], result.top_logprobs[at: at + n],
                                           strict=True))
            at += n
        if release:
            for s, t in zip(result.slots, out, strict=True):
                if t.finish_reason:
                    self.slots.finished(s, t.request_id)
        return out
