"""In-memory mirror of a hybrid model's state slots: who owns each slot, the snapshots, and the step's changes.

A hybrid model (recurrent layers beside attention) keeps, per sequence, every recurrent layer's conv window and
recurrent matrix in one fixed-size *state slot* of the worker. Unlike KV blocks a slot does not grow: a request
takes one when it joins the worker's batch and gives it back when it leaves (finished, aborted, preempted).

A slot may also hold a *snapshot*: the state after the first `num_tokens` tokens of some prefix, keyed by the
chained hash of that prefix's last full block (block_pool.hash_block), so that a later request with the same
prefix starts from it instead of from zero (the prefix cache: KV blocks alone do not give a recurrent layer its
state). A snapshot is *pending* from the step that saves it until that step's result confirms it, then *ready*:
in the index, evictable in LRU order. Snapshots take at most `max_snapshots` slots, and a request that needs a slot
evicts the least recently used ready one, so snapshots never keep a request out.

The pool records which slots changed since the last `take_changes`, so the step's Redis commit writes only those.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

# A slot's owner as the ledger stores it (`record`): "r:<request id>", "p:<request id>" (a pending snapshot that
# request's step saves), "s:<key hex>:<num_tokens>:<lru tick>" (a ready snapshot); free slots have no record.
OWNER_REQUEST, OWNER_PENDING, OWNER_SNAPSHOT = "r", "p", "s"


class NoFreeStateSlots(Exception):
    pass


@dataclass(frozen=True)
class Snapshot:
    key: bytes  # the chained hash of the prefix's last full block
    num_tokens: int  # the prefix's length (a block boundary)
    lru_tick: int = 0


@dataclass(frozen=True)
class PendingSave:
    """A snapshot a scheduled step saves: `slot` holds request `request_id`'s state (its slot `src`) after
    `num_tokens` tokens once the step is confirmed; `decode` marks a boundary past the prompt's (only the request's
    latest such snapshot is kept)."""

    request_id: str
    src: int
    slot: int
    num_tokens: int
    decode: bool = False


class StateSlotPool:
    def __init__(self, num_slots: int, max_snapshots: int, snapshots: dict[int, Snapshot] | None = None):
        if not 0 <= max_snapshots <= num_slots:
            raise ValueError(f"max_snapshots {max_snapshots} outside 0..{num_slots}")
        self.num_slots = num_slots
        self.max_snapshots = max_snapshots
        self.owner: dict[int, str] = {}  # slot -> request id, for slots held by requests
        self.pending: dict[int, str] = {}  # slot -> request id whose step in flight saves a snapshot into it
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot of a ready snapshot, LRU first
        self.snapshot: dict[int, Snapshot] = {}  # slot -> the ready snapshot it holds
        for slot, snap in sorted((snapshots or {}).items(), key=lambda kv: kv[1].lru_tick):
            self.index[snap.key] = slot
            self.snapshot[slot] = snap
        self.lru_tick = max((s.lru_tick for s in self.snapshot.values()), default=0)
        self.free: list[int] = [s for s in range(num_slots) if s not in self.snapshot]  # a heap
        heapq.heapify(self.free)
        self.pinned: set[int] = set()  # snapshots read by a copy in the step being scheduled: not evictable in it
        self.changed: set[int] = set()

    # ---- counts ------------------------------------------------------------------------------------------------

    @property
    def num_snapshots(self) -> int:
        """Ready and pending snapshots (what the budget bounds)."""
        return len(self.snapshot) + len(self.pending)

    @property
    def num_available(self) -> int:
        """Slots a request could take now: free ones and ready snapshots it may evict."""
        return len(self.free) + len(self.snapshot) - len(self.pinned & self.snapshot.keys())

    @property
    def usage(self) -> float:
        """Share of the slots held by requests or snapshots."""
        return (self.num_slots - len(self.free)) / self.num_slots if self.num_slots else 0.0

    @property
    def snapshot_share(self) -> float:
        return self.num_snapshots / self.num_slots if self.num_slots else 0.0

    # ---- requests ------------------------------------------------------------------------------------------------

    def allocate(self, request_id: str) -> int:
        """A slot for a request joining the worker's batch: a free one, else the least recently used snapshot."""
        slot = self._take_slot()
        if slot is None:
            raise NoFreeStateSlots(f"all {self.num_slots} state slots are held by requests or in use this step")
        self.owner[slot] = request_id
        return slot

    def release(self, slot: int) -> None:
        """A request left the worker's batch (finished, aborted, preempted, requeued)."""
        if slot < 0:
            return
        if self.owner.pop(slot, None) is None:
            raise ValueError(f"state slot {slot} is not held by a request")
        self._free(slot)

    # ---- snapshots ---------------------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The slot of a ready snapshot with this key, or None."""
        return self.index.get(key)

    def use(self, slot: int) -> None:
        """A copy in the step being scheduled reads this snapshot: most recently used, and kept for this step."""
        key = self.snapshot[slot].key
        self.index.move_to_end(key)
        self.lru_tick += 1
        self.snapshot[slot] = Snapshot(key, self.snapshot[slot].num_tokens, self.lru_tick)
        self.pinned.add(slot)
        self.changed.add(slot)

    def reserve_snapshot(self, request_id: str) -> int | None:
        """A slot for a snapshot the step being scheduled saves, or None when the budget (after evicting the least
        recently used snapshot) or the free slots do not allow one: snapshots never take a request's slot."""
        if self.num_snapshots >= self.max_snapshots and not self._evict_one():
            return None
        if not self.free and not self._evict_one():
            return None
        slot = heapq.heappop(self.free)
        self.pending[slot] = request_id
        self.changed.add(slot)
        return slot

    def confirm(self, slot: int, key: bytes, num_tokens: int) -> bool:
        """The step that saved into `slot` ran: it now holds the state after `num_tokens` tokens of the prefix
        `key`. False (and the slot freed) when a snapshot with that key exists already."""
        self.pending.pop(slot)
        if key in self.index:
            self._free(slot)
            return False
        self.lru_tick += 1
        self.index[key] = slot
        self.snapshot[slot] = Snapshot(key, num_tokens, self.lru_tick)
        self.changed.add(slot)
        return True

    def cancel(self, slot: int) -> None:
        """A pending snapshot that will not be confirmed (its step was lost, or its request left meanwhile)."""
        if self.pending.pop(slot, None) is not None:
            self._free(slot)

    def drop(self, slot: int) -> None:
        """Forget a ready snapshot (superseded by a later one of the same request)."""
        snap = self.snapshot.pop(slot, None)
        if snap is not None:
            del self.index[snap.key]
            self._free(slot)

    def drop_all(self) -> None:
        """The worker's state is gone or unknown: no snapshot is valid any more (pending ones included)."""
        for slot in list(self.snapshot):
            self.drop(slot)
        for slot in list(self.pending):
            self.cancel(slot)

    def end_step(self) -> None:
        """The step being scheduled is planned: its copies are in the plan, ahead of any later step's writes."""
        self.pinned.clear()

    # ---- ledger ------------------------------------------------------------------------------------------------

    def record(self, slot: int) -> str:
        """What the ledger stores for the slot ("" = free)."""
        if slot in self.owner:
            return f"{OWNER_REQUEST}:{self.owner[slot]}"
        if slot in self.pending:
            return f"{OWNER_PENDING}:{self.pending[slot]}"
        snap = self.snapshot.get(slot)
        if snap is not None:
            return f"{OWNER_SNAPSHOT}:{snap.key.hex()}:{snap.num_tokens}:{snap.lru_tick}"
        return ""

    def take_changes(self) -> dict[int, str]:
        out = {s: self.record(s) for s in self.changed}
        self.changed.clear()
        return out

    def check(self, request_slots: dict[str, int]) -> None:
        """Ledger invariant: free + held + pending + snapshots == total, each slot in one place, and the requests'
        slots exactly those held (raises AssertionError)."""
        free = set(self.free)
        assert len(free) == len(self.free), "a state slot is on the free list twice"
        places = [free, set(self.owner), set(self.pending), set(self.snapshot)]
        assert sum(map(len, places)) == self.num_slots, "free + held + pending + snapshots != num_state_slots"
        assert set().union(*places) == set(range(self.num_slots)), "a state slot is in two places"
        assert {self.owner[s]: s for s in self.owner} == request_slots, "state slots disagree with the requests"
        assert {slot: snap.key for slot, snap in self.snapshot.items()} == {s: k for k, s in self.index.items()}
        assert len(self.snapshot) + len(self.pending) <= self.max_snapshots, "snapshots over their budget"

    # ---- helpers -----------------------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        if self.free:
            slot = heapq.heappop(self.free)
        elif self._evict_one():
            slot = heapq.heappop(self.free)
        else:
            return None
        self.changed.add(slot)
        return slot

    def _evict_one(self) -> bool:
        """Free the least recently used ready snapshot not read this step."""
        for slot in self.index.values():
            if slot not in self.pinned:
                self.drop(slot)
                return True
        return False

    def _free(self, slot: int) -> None:
        heapq.heappush(self.free, slot)
        self.changed.add(slot)


def parse_record(record: str) -> tuple[str, str | Snapshot]:
    """(kind, request id or Snapshot) from a ledger record."""
    kind, _, rest = record.partition(":")
    if kind == OWNER_SNAPSHOT:
        key, num_tokens, tick = rest.rsplit(":", 2)
        return kind, Snapshot(bytes.fromhex(key), int(num_tokens), int(tick))
    return kind, rest


def from_records(num_slots: int, max_snapshots: int, records: dict[int, str]) -> StateSlotPool:
    """The pool a new leader rebuilds from the ledger: ready snapshots stay (the most recent ones, within the
    budget); slots held by requests or pending snapshots are free (every request is resumed by recompute) and
    marked changed, so that the next commit writes them free."""
    snaps = {}
    for slot, record in records.items():
        kind, what = parse_record(record)
        if kind == OWNER_SNAPSHOT and 0 <= slot < num_slots:
            snaps[slot] = what
    kept = dict(sorted(snaps.items(), key=lambda kv: kv[1].lru_tick)[len(snaps) - max_snapshots:]) \
        if len(snaps) > max_snapshots else snaps
    pool = StateSlotPool(num_slots, max_snapshots, kept)
    pool.changed.update(s for s in records if s not in kept)
    return pool
