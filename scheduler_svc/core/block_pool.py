"""In-memory mirror of one KV block pool: reference counts, a free list, the prefix-cache index, and the
step's changes.

A block is free only when its reference count is zero. A free block that still holds a computed, hashed
full block of tokens is *evictable*: it stays in the prefix-cache index (a later request with the same
prefix takes it back) until allocation needs it. Allocation takes never-used blocks first, then evicts the
least recently used cached block and drops its hash. The pool records which blocks changed since the last
`take_changes`, so the step's Redis commit writes only those.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocks(Exception):
    pass


@dataclass(frozen=True)
class BlockState:
    """What the ledger stores for one block."""

    ref_count: int
    hash: bytes | None = None
    tokens: tuple[int, ...] = ()
    lru_tick: int = 0  # order among evictable blocks (older first)


def hash_block(parent: bytes | None, tokens: tuple[int, ...], salt: str = "") -> bytes:
    """Content hash of a full block, chained over its parent's hash and an optional tenant salt."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(salt.encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, free_ids: list[int] | None = None, refs: dict[int, int] | None = None,
                 cached: dict[int, tuple[bytes, tuple[int, ...]]] | None = None,
                 evictable: list[int] | dict[int, int] | None = None):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        for b, n in (refs or {}).items():
            self.ref_counts[b] = n
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.index: dict[bytes, int] = {}  # hash -> block holding it
        for b, (h, toks) in (cached or {}).items():
            self.block_hash[b] = h
            self.block_tokens[b] = toks
            self.index.setdefault(h, b)
        # Evictable blocks in LRU order, each with the tick at which it became evictable (persisted). `evictable`
        # is a list in LRU order, or block -> stored tick: new ticks must continue above the stored ones, or a
        # block freed after a reload would sort before older blocks in the ledger.
        if isinstance(evictable, dict):
            order = sorted(evictable.items(), key=lambda kv: kv[1])
        else:
            order = [(b, i + 1) for i, b in enumerate(evictable or [])]
        self.evictable: OrderedDict[int, int] = OrderedDict(order)
        self.lru_tick = max(self.evictable.values(), default=0)
        if free_ids is None:
            free_ids = [b for b in range(num_blocks) if self.ref_counts[b] == 0 and b not in self.evictable]
        self.free: deque[int] = deque(free_ids)  # never used, or used without a hash
        self.changed: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)  # least recently used
                self._forget_hash(b)
            self.ref_counts[b] = 1
            ids.append(b)
        self.changed.update(ids)
        return ids

    def release(self, ids: list[int]) -> None:
        """Drop one reference to each block, tail first, so deep blocks are evicted before shared roots."""
        for b in reversed(ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.lru_tick += 1
                    self.evictable[b] = self.lru_tick  # most recently used end
                else:
                    self.free.append(b)
            self.changed.add(b)

    # ---- prefix cache ------------------------------------------------------------------------------------

    def cached_prefix(self, hashes: list[bytes], token_blocks: Iterable[tuple[int, ...]]) -> list[int]:
        """The longest run of leading blocks found in the index, verified against their stored tokens."""
        hits = []
        for h, toks in zip(hashes, token_blocks, strict=False):
            b = self.index.get(h)
            if b is None or self.block_tokens.get(b) != toks:
                break
            hits.append(b)
        return hits

    def num_evictable_in(self, ids: list[int]) -> int:
        return sum(1 for b in ids if b in self.evictable)

    def take(self, ids: list[int]) -> None:
        """Add a reference to cached blocks (a prefix hit); evictable ones leave the free capacity."""
        for b in ids:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        self.changed.update(ids)

    def register(self, b: int, h: bytes, tokens: tuple[int, ...]) -> None:
        """Block `b` now holds the computed KV of a full block with hash `h`."""
        if self.block_hash[b] is not None:
            return
        if h in self.index:
            return  # another block already holds this content; this one stays private
        self.block_hash[b] = h
        self.block_tokens[b] = tokens
        self.index[h] = b
        self.changed.add(b)

    def drop_all_hashes(self) -> None:
        """The worker's KV cache is gone (new epoch) or unknown: nothing cached is valid any more."""
        for b, h in enumerate(self.block_hash):
            if h is not None:
                self._forget_hash(b)
                self.changed.add(b)
        self.free.extend(self.evictable)
        self.evictable.clear()

    def _forget_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.index.get(h) == b:
            del self.index[h]
        self.block_hash[b] = None
        self.block_tokens.pop(b, None)

    # ---- ledger ------------------------------------------------------------------------------------------

    def take_changes(self) -> dict[int, BlockState]:
        """Blocks whose state changed since the last call -> their state now."""
        out = {}
        for b in self.changed:
            out[b] = BlockState(self.ref_counts[b], self.block_hash[b], self.block_tokens.get(b, ()),
                                self.evictable.get(b, 0))
        self.changed.clear()
        return out

    def check(self, owners: list[list[int]]) -> None:
        """Ledger invariant: free + evictable + allocated == total, and counts equal the block tables' references."""
        expected = [0] * self.num_blocks
        for table in owners:
            for b in table:
                expected[b] += 1
        assert expected == self.ref_counts, "reference counts disagree with the block tables"
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        assert not free & set(self.evictable), "a block is both free and evictable"
        zero = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        assert free | set(self.evictable) == zero, "free + evictable != zero-count blocks"
        assert all(self.block_hash[b] is not None for b in self.evictable), "an evictable block has no hash"
        assert all(self.block_hash[b] is None for b in free), "a plain free block still has a hash"
        for h, b in self.index.items():
            assert self.block_hash[b] == h, "the hash index points at a block holding another hash"
        assert len(free) + len(self.evictable) + sum(1 for n in self.ref_counts if n > 0) == self.num_blocks
