"""In-memory mirror of one KV block pool: reference counts, a free list, and the step's changes.

A block is free only when its reference count is zero (shared prefix blocks come later).
The pool records which blocks changed state since the last `take_changes`, so the step's
Redis commit writes only those.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, free_ids: list[int] | None = None, refs: dict[int, int] | None = None):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        for b, n in (refs or {}).items():
            self.ref_counts[b] = n
        free = free_ids if free_ids is not None else [b for b in range(num_blocks) if self.ref_counts[b] == 0]
        self.free: deque[int] = deque(free)
        self.changed: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free)} free")
        ids = [self.free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        self.changed.update(ids)
        return ids

    def release(self, ids: list[int]) -> None:
        """Drop one reference to each block, tail first, so deep blocks return before shared roots."""
        for b in reversed(ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free.append(b)
            self.changed.add(b)

    def take_changes(self) -> dict[int, int]:
        """Blocks whose count changed since the last call -> their count now."""
        out = {b: self.ref_counts[b] for b in self.changed}
        self.changed.clear()
        return out

    def check(self, owners: list[list[int]]) -> None:
        """Ledger invariant: free + allocated == total, and counts equal the block tables' references."""
        expected = [0] * self.num_blocks
        for table in owners:
            for b in table:
                expected[b] += 1
        assert expected == self.ref_counts, "reference counts disagree with the block tables"
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}, "free list != zero-count blocks"
        assert len(free) + sum(1 for n in self.ref_counts if n > 0) == self.num_blocks
