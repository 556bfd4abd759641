"""Which request holds which slot of the worker's batch: the addresses the worker protocol uses instead of ids.

The scheduler's edge (worker_client) keeps this table, not the core: a request takes the lowest free slot when it
joins the worker's batch (a new or resumed plan entry) and gives it back when it leaves it, so that slots stay
dense (the worker keeps slot s in row s of its arrays). A request leaves when a plan drops it (finished, aborted,
preempted) or when a result reports that the worker finished it; a reset of the worker's batch empties the table.
"""

from __future__ import annotations

import heapq


class SlotTable:
    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.owner: list[str | None] = []  # slot -> request id
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first
        # A step failed, so what the worker holds is unknown: the next plan must reset its batch.
        self.stale = False

    def __len__(self) -> int:
        return len(self.slot_of)

    def clear(self) -> None:
        self.owner, self.slot_of, self._free, self.stale = [], {}, [], False

    def join(self, request_id: str) -> int:
        if request_id in self.slot_of:
            raise ValueError(f"request {request_id!r} already holds slot {self.slot_of[request_id]}")
        if self._free:
            slot = heapq.heappop(self._free)
        elif len(self.owner) < self.max_slots:
            slot = len(self.owner)
            self.owner.append(None)
        else:
            raise RuntimeError(f"all {self.max_slots} worker slots are taken")
        self.owner[slot] = request_id
        self.slot_of[request_id] = slot
        return slot

    def leave(self, request_id: str) -> int | None:
        """Free the request's slot; returns it, or None when it holds none (the worker finished it already)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.owner[slot] = None
            heapq.heappush(self._free, slot)
        return slot

    def finished(self, slot: int, request_id: str) -> None:
        """The worker finished (and forgot) `request_id`, which held `slot` in that step. A plan sent since may
        have dropped it already, and given the slot to another request: that one keeps it."""
        if slot < len(self.owner) and self.owner[slot] == request_id:
            self.leave(request_id)

    def snapshot(self) -> list[str | None]:
        """slot -> request id now: how the result of the plan just encoded is read."""
        return list(self.owner)
