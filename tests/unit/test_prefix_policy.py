"""Prefix caching and parallel sampling, pure: the block pool's cache, the policy's prefix admission and
copy-on-write, and the engine's fork logic driven against a fake worker that tracks every KV slot.

The fake worker uses the real worker's PersistentBatch (so the plans are checked and applied exactly as the real
worker does) and keeps, per KV slot, which (token, position) was last written there. Every step it writes the
scheduled tokens' slots first, then checks that every position a scheduled chunk attends to holds that request's
own token: a prefix hit on the wrong block, a missing copy-on-write, a shared block written in place or a block
reused while still referenced all show up as a wrong slot. Its "model" samples a pure function of the seed (none
when greedy) and the whole token sequence, so every output is known in advance.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import numpy as np
import pytest

from common.sampling_fields import SamplingParams
from protos import llmserve_pb2 as pb
from protos import worker_pb2 as wpb
from scheduler_svc.core.block_pool import BlockPool, NoFreeBlocks, hash_block
from scheduler_svc.core.policy import PolicyConfig, schedule
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.driver.admission import Limits, build_requests
from scheduler_svc.driver.driver import Driver, DriverConfig
from scheduler_svc.metrics import Metrics
from worker_svc.core.persistent_batch import BatchLimits, PersistentBatch
from worker_svc.wire import skip_finished_requests, step_plan

BS = 4
VOCAB = 500


def toks(n: int, base: int = 1) -> list[int]:
    return [(base * 37 + i * 11) % (VOCAB - 2) + 1 for i in range(n)]


def block_tokens(ids: list[int], bs: int = BS) -> list[tuple[int, ...]]:
    return [tuple(ids[i * bs : (i + 1) * bs]) for i in range(len(ids) // bs)]


def hashes(ids: list[int], salt: str = "", bs: int = BS) -> list[bytes]:
    out: list[bytes] = []
    for t in block_tokens(ids, bs):
        out.append(hash_block(out[-1] if out else None, t, salt))
    return out


def cache_blocks(pool: BlockPool, ids: list[int], salt: str = "") -> list[int]:
    """Allocate, register and release the full blocks of `ids` (a finished request that left them cached)."""
    hs, ts = hashes(ids, salt), block_tokens(ids)
    blocks = pool.allocate(len(hs))
    for b, h, t in zip(blocks, hs, ts, strict=True):
        pool.register(b, h, t)
    pool.release(blocks)
    return blocks


# ---------------------------------------------------------------- block pool


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hashes(toks(8, 1))
    assert len(a) == 2 and a[0] != a[1]
    assert hashes(toks(8, 1)) == a
    assert hashes(toks(8, 1), salt="tenant") != a
    # Same second block, different first block: a different chained hash.
    other = toks(4, 2) + toks(8, 1)[4:]
    assert hashes(other)[1] != a[1]
    # No ambiguity from token boundaries: (1, 23) and (12, 3) differ.
    assert hash_block(None, (1, 23), "") != hash_block(None, (12, 3), "")


def test_never_used_blocks_go_first_then_least_recently_used():
    p = BlockPool(6)
    c1 = cache_blocks(p, toks(8, 1))  # 2 blocks, evictable
    c2 = cache_blocks(p, toks(4, 2))  # 1 block, evictable, more recent
    assert p.num_free == 6 and len(p.evictable) == 3 and len(p.free) == 3
    got = p.allocate(3)
    assert set(got).isdisjoint(c1 + c2), "never-used blocks must be taken before evicting cached ones"
    assert len(p.index) == 3
    # Next: LRU order. c1 was released tail first, so its deeper block is evicted before its root, then c2.
    assert p.allocate(1) == [c1[1]]
    assert p.cached_prefix(hashes(toks(8, 1)), block_tokens(toks(8, 1))) == [c1[0]]
    assert p.allocate(1) == [c1[0]]
    assert p.allocate(1) == c2
    assert p.index == {} and p.num_free == 0
    with pytest.raises(NoFreeBlocks):
        p.allocate(1)
    p.check([got, [c1[1]], [c1[0]], c2])


def test_release_is_tail_first_and_hits_refresh_lru_position():
    p = BlockPool(8)
    a = cache_blocks(p, toks(12, 1))  # 3 blocks: evictable order a2, a1, a0
    b = cache_blocks(p, toks(8, 2))  # then b1, b0
    assert list(p.evictable) == [a[2], a[1], a[0], b[1], b[0]]
    # A hit on a's first two blocks takes them out of the LRU; releasing them again puts them at the recent end.
    hit = p.cached_prefix(hashes(toks(12, 1))[:2], block_tokens(toks(12, 1))[:2])
    assert hit == a[:2]
    p.take(hit)
    assert p.num_free == 8 - 2 and list(p.evictable) == [a[2], b[1], b[0]]
    p.check([hit])
    p.release(hit)
    assert list(p.evictable) == [a[2], b[1], b[0], a[1], a[0]]
    ticks = list(p.evictable.values())
    assert ticks == sorted(ticks)


def test_take_shared_cached_block_counts_references():
    p = BlockPool(4)
    (blk,) = cache_blocks(p, toks(4, 1))
    p.take([blk])
    p.take([blk])
    assert p.ref_counts[blk] == 2 and blk not in p.evictable
    p.check([[blk], [blk]])
    p.release([blk])
    assert blk not in p.evictable and p.num_free == 3
    p.release([blk])
    assert blk in p.evictable and p.num_free == 4
    p.check([])


def test_hit_is_verified_against_stored_tokens_not_the_hash_alone():
    p = BlockPool(4)
    ids = toks(8, 1)
    blocks = cache_blocks(p, ids)
    assert p.cached_prefix(hashes(ids), block_tokens(ids)) == blocks
    # A colliding hash (simulated: the right hashes with other tokens) must not hit.
    wrong = list(ids)
    wrong[5] += 1
    assert p.cached_prefix(hashes(ids), block_tokens(wrong)) == blocks[:1]
    wrong[1] += 1
    assert p.cached_prefix(hashes(ids), block_tokens(wrong)) == []
    # Stored tokens corrupted (e.g. a ledger mixed up): no hit either.
    p.block_tokens[blocks[0]] = (0, 0, 0, 0)
    assert p.cached_prefix(hashes(ids), block_tokens(ids)) == []


def test_register_keeps_one_block_per_content():
    p = BlockPool(4)
    ids = toks(4, 1)
    h, t = hashes(ids)[0], block_tokens(ids)[0]
    a, b = p.allocate(2)
    p.register(a, h, t)
    p.register(b, h, t)  # same content computed twice (two requests in the same step): b stays private
    assert p.index == {h: a} and p.block_hash[b] is None
    p.register(a, hashes(toks(4, 2))[0], block_tokens(toks(4, 2))[0])  # already registered: unchanged
    assert p.block_hash[a] == h
    p.release([a, b])
    assert list(p.evictable) == [a] and b in p.free
    p.check([])


def test_drop_all_hashes_forgets_everything_and_frees_evictable():
    p = BlockPool(6)
    cache_blocks(p, toks(8, 1))
    held = p.allocate(2)
    for blk, h, t in zip(held, hashes(toks(8, 3)), block_tokens(toks(8, 3)), strict=True):
        p.register(blk, h, t)
    p.take_changes()
    p.drop_all_hashes()
    assert p.index == {} and not p.evictable and p.num_free == 4
    assert all(h is None for h in p.block_hash) and p.block_tokens == {}
    assert p.cached_prefix(hashes(toks(8, 1)), block_tokens(toks(8, 1))) == []
    changes = p.take_changes()
    assert all(st.hash is None for st in changes.values())
    assert {b for b, st in changes.items() if st.ref_count} == set(held)
    p.check([held])
    p.release(held)  # no hash any more: plain free
    assert len(p.free) == 6
    p.check([])


def apply_changes(ledger: dict, pool: BlockPool) -> None:
    """What the Redis commit does with `take_changes()` (free set, evict zset by tick, refs, bhash)."""
    for b, st in pool.take_changes().items():
        ledger["refs"].pop(b, None)
        ledger["free"].discard(b)
        ledger["evict"].pop(b, None)
        ledger["bhash"].pop(b, None)
        if st.ref_count > 0:
            ledger["refs"][b] = st.ref_count
        elif st.hash is not None:
            ledger["evict"][b] = st.lru_tick
        else:
            ledger["free"].add(b)
        if st.hash is not None:
            ledger["bhash"][b] = (st.hash, st.tokens)


def load(ledger: dict, num_blocks: int) -> BlockPool:
    """What RedisLedger.load() builds from those keys (the evictable blocks with their stored ticks)."""
    return BlockPool(num_blocks, free_ids=sorted(ledger["free"]), refs=dict(ledger["refs"]),
                     cached=dict(ledger["bhash"]), evictable=dict(ledger["evict"]))


def test_lru_order_survives_reloads_of_the_ledger():
    """A restarted scheduler rebuilds the pool from the ledger; the LRU order must not scramble across restarts
    (a block freed after a restart is more recent than every block freed before it)."""
    n = 8
    ledger: dict = {"free": set(range(n)), "evict": {}, "refs": {}, "bhash": {}}
    p = BlockPool(n)
    a = cache_blocks(p, toks(4, 1))
    b = cache_blocks(p, toks(4, 2))
    for _ in range(3):  # a is hit and released again: its tick grows past the number of evictable blocks
        p.take(a)
        p.release(a)
    apply_changes(ledger, p)
    p2 = load(ledger, n)  # scheduler restart
    assert list(p2.evictable) == b + a
    c = cache_blocks(p2, toks(4, 3))  # freed after the restart: the most recent
    apply_changes(ledger, p2)
    p3 = load(ledger, n)  # another restart
    assert list(p3.evictable) == b + a + c, "LRU order scrambled by a reload"
    p3.allocate(n - 3)
    assert p3.allocate(1) == b, "the least recently used block must be evicted first"


# ---------------------------------------------------------------- policy: prefix admission


def cfg_(**kw) -> PolicyConfig:
    base = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=BS, enable_prefix_caching=True)
    base.update(kw)
    return PolicyConfig(**base)


def req_(rid: str, ids: list[int], salt: str = "", max_tokens: int = 4) -> Request:
    return Request(request_id=rid, prompt_ids=list(ids), sampling=SamplingParams(max_tokens=max_tokens),
                   cache_salt=salt)


@pytest.mark.parametrize("length, expect_hit_blocks", [(12, 2), (13, 3), (14, 3), (15, 3), (16, 3), (3, 0), (4, 0)])
def test_fully_cached_prompt_always_computes_at_least_one_token(length, expect_hit_blocks):
    pool = BlockPool(16)
    ids = toks(length, 5)
    cached = cache_blocks(pool, ids)
    r = req_("r", ids)
    out = schedule(deque([r]), [], pool, cfg_())
    assert out.admitted == [r]
    assert r.block_ids[:expect_hit_blocks] == cached[:expect_hit_blocks]
    assert r.num_cached_tokens == r.num_computed_tokens == expect_hit_blocks * BS
    assert out.num_tokens["r"] == length - expect_hit_blocks * BS >= 1
    assert len(r.block_ids) == -(-length // BS) and out.new_blocks["r"] == r.block_ids[expect_hit_blocks:]
    assert r.num_registered_blocks == expect_hit_blocks
    pool.check([r.block_ids])


def test_prompts_diverging_mid_block_share_only_the_full_blocks_before():
    pool = BlockPool(16)
    a = toks(10, 1)  # blocks [0:4] [4:8], then 2 tokens
    cached = cache_blocks(pool, a + [7, 7])  # 3 full blocks cached
    b = a[:6] + [9, 9, 9, 9, 9]  # diverges inside the second block
    r = req_("b", b)
    schedule(deque([r]), [], pool, cfg_())
    assert r.num_computed_tokens == 4 and r.block_ids[0] == cached[0] and cached[1] not in r.block_ids


def test_cache_salt_isolates_tenants():
    pool = BlockPool(16)
    ids = toks(12, 1)
    cache_blocks(pool, ids, salt="a")
    r = req_("r", ids, salt="b")
    schedule(deque([r]), [], pool, cfg_())
    assert r.num_computed_tokens == 0
    r2 = req_("r2", ids, salt="a")
    schedule(deque([r2]), [], pool, cfg_())
    assert r2.num_computed_tokens == 8


def test_caching_off_ignores_the_index():
    pool = BlockPool(16)
    ids = toks(12, 1)
    cache_blocks(pool, ids)
    r = req_("r", ids)
    schedule(deque([r]), [], pool, cfg_(enable_prefix_caching=False))
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == 0


def test_evictable_hits_are_not_counted_twice_as_free_capacity():
    # 4 blocks, all evictable and all hits for a 17-token prompt: it needs its 4 cached + 1 new = 5 > 4.
    pool = BlockPool(4)
    ids = toks(17, 1)
    cache_blocks(pool, ids[:16])
    r = req_("r", ids)
    w = deque([r])
    out = schedule(w, [], pool, cfg_())
    assert out.admitted == [] and list(w) == [r] and r.num_computed_tokens == 0
    assert pool.num_free == 4 and len(pool.index) == 4  # nothing taken, nothing evicted
    pool.check([])
    # With one block fewer needed (13 tokens: 3 hits + 1 new), it fits exactly: the 4th cached block is evicted.
    r2 = req_("r2", ids[:13])
    out = schedule(deque([r2]), [], pool, cfg_())
    assert out.admitted == [r2] and r2.num_computed_tokens == 12 and pool.num_free == 0
    pool.check([r2.block_ids])


def test_hits_of_a_preempted_request_cover_its_outputs_too():
    pool = BlockPool(16)
    r = req_("r", toks(6, 1), max_tokens=20)
    r.output_ids = toks(7, 9)  # 13 tokens known
    cache_blocks(pool, r.all_token_ids)
    schedule(deque([r]), [], pool, cfg_())
    assert r.num_computed_tokens == 12 and r.num_cached_tokens == 12


# ---------------------------------------------------------------- policy: copy-on-write


def shared_running(pool: BlockPool, prompt_len: int, n: int) -> list[Request]:
    """n running sequences sharing one computed prompt (as forks leave them), each about to write."""
    ids = toks(prompt_len, 3)
    table = pool.allocate(-(-prompt_len // BS))
    seqs = []
    for i in range(n):
        if i:
            pool.take(table)
        r = req_(f"s{i}", ids, max_tokens=10)
        r.block_ids = list(table)
        r.num_computed_tokens = prompt_len if i == 0 else prompt_len - 1
        if i == 0:
            r.output_ids = [42]
        r.status = Status.RUNNING
        seqs.append(r)
    return seqs


def test_copy_on_write_of_a_shared_partial_block():
    pool = BlockPool(16)
    seqs = shared_running(pool, 6, 3)  # block 1 holds tokens 4..5 and is shared by three sequences
    shared = seqs[0].block_ids[1]
    assert pool.ref_counts[shared] == 3
    running = list(seqs)
    out = schedule(deque(), running, pool, cfg_())
    # The first two copy the shared block; the last one then holds it alone and writes in place.
    assert [dst for _, dst in out.copies] == [seqs[0].block_ids[1], seqs[1].block_ids[1]]
    assert all(src == shared for src, _ in out.copies)
    assert seqs[2].block_ids[1] == shared and pool.ref_counts[shared] == 1
    assert out.replaced_tables == {"s0", "s1"}
    assert out.new_blocks == {"s0": [], "s1": [], "s2": []}
    assert len({r.block_ids[1] for r in seqs}) == 3 and len({r.block_ids[0] for r in seqs}) == 1
    pool.check([r.block_ids for r in seqs])


def test_copy_on_write_of_a_full_shared_block_when_the_last_prompt_token_is_recomputed():
    pool = BlockPool(16)
    seqs = shared_running(pool, 8, 2)  # prompt fills 2 blocks; s1 recomputes token 7, in shared block 1
    out = schedule(deque(), list(seqs), pool, cfg_())
    # s0 decodes token 8 into a new block (no copy); s1 writes into block 1 -> its own copy.
    assert out.num_tokens == {"s0": 1, "s1": 1}
    assert len(out.copies) == 1 and out.copies[0][0] == seqs[0].block_ids[1]
    assert out.replaced_tables == {"s1"} and len(out.new_blocks["s0"]) == 1
    pool.check([r.block_ids for r in seqs])


def test_a_sequence_whose_sharer_was_preempted_writes_in_place_instead_of_preempting_itself():
    # Pool of 3: s0, s1, s2 share blocks 0-1 (tokens 0..5). s0 copies block 1 into the last free block; s1 then
    # needs a copy and nothing is free, so s2 (the latest) is preempted. That leaves s1 the only holder of block
    # 1: it writes in place and runs, rather than preempting itself too.
    pool = BlockPool(3)
    s0, s1, s2 = shared_running(pool, 6, 3)
    waiting: deque[Request] = deque()
    out = schedule(waiting, [s0, s1, s2], pool, cfg_())
    assert out.preempted == [s2] and list(waiting) == [s2] and s2.block_ids == []
    assert out.scheduled == [s0, s1] and len(out.copies) == 1 and out.replaced_tables == {"s0"}
    assert pool.ref_counts[s1.block_ids[1]] == 1
    pool.check([s0.block_ids, s1.block_ids])


def test_preempting_a_sequence_after_its_copy_drops_the_copy_from_the_step():
    # Pool of 4: sA and sB share blocks 0-1 (prompt 6); c holds 1 full block and needs a new one. sA (worst
    # priority) copies block 1 into the last free block; c then needs a block: sA is the victim, its copy goes
    # back to the pool (c takes it) and must leave the plan.
    pool = BlockPool(4)
    sa, sb = shared_running(pool, 6, 2)
    c = req_("c", toks(4, 9), max_tokens=10)
    c.output_ids, c.num_computed_tokens, c.block_ids, c.status = [5], 4, pool.allocate(1), Status.RUNNING
    sa.priority, sa.arrival_seq, sb.arrival_seq, c.arrival_seq = 5, 0, 1, 2
    out = schedule(deque(), [sa, sb, c], pool, cfg_(scheduling_policy="priority"))
    assert out.preempted == [sa] and out.scheduled == [sb, c]
    assert out.copies == [] and out.replaced_tables == set(), "a preempted sequence's copy must leave the plan"
    pool.check([sb.block_ids, c.block_ids])


# ---------------------------------------------------------------- the engine against a fake worker


def fake_model(seed: int, greedy: bool, ids: list[int]) -> int:
    """The next token: a pure function of the (seed unless greedy and) the whole sequence."""
    data = ",".join(map(str, ids)).encode()
    return zlib.crc32(data, 0 if greedy else seed % (1 << 32)) % (VOCAB - 1) + 1


def expected_output(prompt: list[int], sampling: SamplingParams) -> list[int]:
    ids = list(prompt)
    for _ in range(sampling.max_tokens):
        ids.append(fake_model(sampling.seed, sampling.temperature == 0, ids))
    return ids[len(prompt):]


class FakeWorker:
    """The real PersistentBatch plus a per-slot record of which (token, position) each KV slot holds."""

    def __init__(self, num_blocks: int, block_size: int, epoch: str = "e1"):
        self.bs = block_size
        self.num_blocks = num_blocks
        self.epoch = epoch
        self.batch = PersistentBatch(BatchLimits(num_blocks, block_size, 1 << 20, VOCAB))
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.copies = 0
        self.tokens_computed = 0
        self.finished: set[int] = set()  # slots finished by the last step (a pipelined plan may still name them)
        self.finished_in_step = 0

    def info(self) -> wpb.WorkerInfo:
        return wpb.WorkerInfo(epoch=self.epoch, block_size=self.bs, num_blocks=self.num_blocks, device="cpu",
                              last_step_id=self.batch.last_step_id, fencing_token=self.batch.fencing_token)

    def Describe(self, request, timeout=None):
        return self.info()

    def ExecuteStep(self, plan: wpb.StepPlan, timeout=None) -> wpb.StepResult:
        if plan.after_step_id and plan.after_step_id == self.finished_in_step:  # as the worker's server does
            skip_finished_requests(plan, self.finished)
        checked = step_plan(plan)
        self.batch.check_plan(checked, self.epoch)
        previous = self.batch.last_step_id
        sched = self.batch.apply_plan(checked)
        inputs = self.batch.inputs
        chunks = list(zip(sched.rows.tolist(), sched.starts.tolist(), sched.lengths.tolist(), strict=True))

        def row_state(row: int) -> tuple[str, list[int], list[int]]:
            return (inputs.request_ids[row], inputs.block_table[row, : inputs.num_blocks[row]].tolist(),
                    inputs.token_ids[row, : inputs.num_tokens[row]].tolist())
        src = {c.src: list(self.kv[c.src]) for c in plan.copy_blocks}  # all copies read before any writes
        for c in plan.copy_blocks:
            self.kv[c.dst] = list(src[c.src])
        self.copies += len(plan.copy_blocks)
        written: dict[tuple[int, int], str] = {}
        for row, start, length in chunks:
            rid, block_ids, token_ids = row_state(row)
            for p in range(start, start + length):
                slot = (block_ids[p // self.bs], p % self.bs)
                assert slot not in written, f"{rid} and {written[slot]} write KV slot {slot} in one step"
                written[slot] = rid
                self.kv[slot[0]][slot[1]] = (token_ids[p], p)
            self.tokens_computed += length
        result = wpb.StepResult(step_id=plan.step_id, previous_step_id=previous)
        reasons: list[int] = []
        for row, start, length in chunks:
            rid, block_ids, token_ids = row_state(row)
            for p in range(start + length):  # what attention reads
                got = self.kv[block_ids[p // self.bs]][p % self.bs]
                assert got == (token_ids[p], p), (f"{rid} reads position {p} from block "
                                                  f"{block_ids[p // self.bs]}: {got}, wants {(token_ids[p], p)}")
            inputs.num_computed_tokens[row] += length
            if start + length == len(token_ids):  # the chunk reached the last known token: it samples
                sampling = inputs.params[row]
                tok = fake_model(sampling.seed, sampling.greedy, token_ids)
                inputs.append_tokens(np.array([row]), np.array([tok]))
                stop = tok in sampling.stop_token_ids
                done = stop or len(token_ids) + 1 - inputs.num_prompt_tokens[row] >= sampling.max_tokens
                reason = wpb.FINISH_REASON_STOP_TOKEN if stop else wpb.FINISH_REASON_MAX_TOKENS
                result.slots.append(row)
                result.token_ids.append(tok)
                reasons.append(reason if done else 0)
                if done:
                    inputs.free(row)
        if any(reasons):
            result.finish_reasons.extend(reasons)
        self.finished = {slot for slot, r in zip(result.slots, reasons, strict=True) if r}
        self.finished_in_step = plan.step_id
        return result


class FakeLedger:
    """Applies each commit's block changes the way the Redis script does, and checks the ledger invariant."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.state: dict = {"free": set(range(num_blocks)), "evict": {}, "refs": {}, "bhash": {}}
        self.commits = 0

    def commit_step(self, holder, token, ttl_ms, commit) -> None:
        st = self.state
        for b, bs in commit.block_changes.items():
            st["refs"].pop(b, None)
            st["free"].discard(b)
            st["evict"].pop(b, None)
            st["bhash"].pop(b, None)
            if bs.ref_count > 0:
                st["refs"][b] = bs.ref_count
            elif bs.hash is not None:
                st["evict"][b] = bs.lru_tick
            else:
                st["free"].add(b)
            if bs.hash is not None:
                st["bhash"][b] = (bs.hash, bs.tokens)
        assert len(st["free"]) + len(st["evict"]) + len(st["refs"]) == self.num_blocks
        self.commits += 1

    def renew_lease(self, *a) -> bool:
        return True

    def set_worker(self, *a):
        return None


def make_engine(num_blocks: int, *, caching: bool = True, budget: int = 24, max_seqs: int = 8,
                block_size: int = BS) -> Driver:
    policy = PolicyConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=block_size,
                          enable_prefix_caching=caching)
    eng = Driver(DriverConfig(policy=policy, worker_address="fake", debug_invariants=True, lease_ttl_ms=30),
                 FakeLedger(num_blocks), Metrics())
    use_worker(eng, FakeWorker(num_blocks, block_size))
    eng.lease.token = 1
    eng.core = SchedulerCore(policy, BlockPool(num_blocks))
    eng.core.reset_worker = False
    eng.ready.set()
    return eng


class FakeStub:
    """The gRPC stub's surface the worker client uses, in front of the fake worker."""

    def __init__(self, worker: FakeWorker):
        self.Describe = worker.Describe
        self.ExecuteStep = lambda plan, timeout=None, metadata=None: worker.ExecuteStep(plan)
        self.ExecuteStep.future = lambda plan, timeout=None, metadata=None: _Done(worker.ExecuteStep(plan))


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value


def use_worker(eng: Driver, worker: FakeWorker) -> None:
    """The driver's worker client talks to the fake instead of a gRPC stub (the plan encoding stays real)."""
    eng.worker.stub, eng.worker.info, eng.fake_worker = FakeStub(worker), worker.info(), worker


def submit(eng: Driver, rid: str, prompt: list[int], *, n: int = 1, temperature: float = 0.0, seed: int = 7,
           max_tokens: int = 6, salt: str = "", stop_token_ids: tuple[int, ...] = ()) -> list[Request]:
    g = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), cache_salt=salt,
                           sampling=pb.SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                      ignore_eos=True, n=n, stop_token_ids=stop_token_ids))
    pol = eng.cfg.policy
    limits = Limits(max_model_len=1 << 20, vocab_size=VOCAB, kv_pool_tokens=eng.core.pool.num_blocks * pol.block_size,
                    block_size=pol.block_size)
    reqs = build_requests(g, prompt, limits, rid)
    eng.submit(reqs)
    return reqs


def run(eng: Driver, max_iterations: int = 5000, on_step=None) -> int:
    """Iterate until nothing is queued, running or pending; returns the iterations taken."""
    for i in range(max_iterations):
        if on_step is not None:
            on_step(eng, i)
        with eng.lock:
            inbox = bool(eng.inbox)
        if not (inbox or eng.core.has_work or eng.core.forks or eng.core.has_uncommitted or eng.in_flight):
            return i
        eng._iteration()
    raise AssertionError("the engine did not drain")


def output(eng: Driver, rid: str) -> list[int]:
    pub = eng.outbox.published[rid]
    assert pub.finish_reason is not None, rid
    return pub.token_ids


def assert_idle_and_clean(eng: Driver) -> None:
    pool = eng.core.pool
    pool.check([])
    assert all(n == 0 for n in pool.ref_counts)
    assert pool.num_free == pool.num_blocks and not eng.core.forks
    st = eng.ledger.state
    assert not st["refs"] and len(st["free"]) + len(st["evict"]) == pool.num_blocks
    assert set(st["evict"]) == set(pool.evictable) and set(st["bhash"]) == {
        b for b, h in enumerate(pool.block_hash) if h is not None}


def hit_tokens(eng: Driver) -> float:
    return eng.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", {"model_name": "model"}) or 0.0


def test_engine_sequential_shared_prefix_hits_and_outputs_match():
    eng = make_engine(64)
    system = toks(22, 1)
    reqs = []
    for i in range(4):
        reqs += submit(eng, f"q{i}", system + toks(3 + i, 10 + i))
        run(eng)
    for r in reqs:
        assert output(eng, r.request_id) == expected_output(r.prompt_ids, r.sampling)
    # The first misses; each later one hits the 5 full blocks of the system prompt (at least).
    assert reqs[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= 20 for r in reqs[1:])
    assert hit_tokens(eng) == sum(r.num_cached_tokens for r in reqs)
    assert_idle_and_clean(eng)


def test_engine_same_prompt_twice_recomputes_only_the_last_block():
    for length in (16, 18):
        eng = make_engine(32)
        p = toks(length, 4)
        a = submit(eng, "a", p)[0]
        run(eng)
        tokens_before = eng.fake_worker.tokens_computed
        b = submit(eng, "b", p)[0]
        run(eng)
        assert b.num_cached_tokens == (length - 1) // BS * BS
        # The second run computes only the uncached tail of the prompt plus its decodes.
        assert eng.fake_worker.tokens_computed - tokens_before == length - b.num_cached_tokens + b.max_tokens - 1
        assert output(eng, "a") == output(eng, "b") == expected_output(p, a.sampling)
        assert_idle_and_clean(eng)


def test_engine_n4_greedy_sequences_share_the_prompt_and_equal_the_single_output():
    for plen in (10, 12):  # last prompt block partial / full
        eng = make_engine(64, caching=False)  # forking shares blocks with or without the cache
        seqs = submit(eng, "g", toks(plen, 2), n=4, max_tokens=5)
        assert [s.request_id for s in seqs] == [f"g#{i}" for i in range(4)]
        single = expected_output(seqs[0].prompt_ids, seqs[0].sampling)
        shared_seen = []

        def watch(e, i, seqs=seqs, shared_seen=shared_seen):
            if all(s.status == Status.RUNNING for s in seqs) and not shared_seen:
                shared_seen.append(e.core.pool.ref_counts[seqs[0].block_ids[0]])

        run(eng, on_step=watch)
        for s in seqs:
            assert output(eng, s.request_id) == single
        assert shared_seen == [4], "the four sequences must share the first prompt block"
        # The prompt is computed once plus one token per sibling, not four times.
        assert eng.fake_worker.tokens_computed == plen + 3 + 4 * 4
        assert eng.fake_worker.copies == 3, "three sequences copy the block holding the last prompt token"
        assert_idle_and_clean(eng)


def test_engine_n4_sampled_sequence_i_uses_seed_plus_i():
    eng = make_engine(64)
    prompt = toks(9, 6)
    seqs = submit(eng, "s", prompt, n=4, temperature=0.8, seed=1000, max_tokens=6)
    run(eng)
    outs = [output(eng, s.request_id) for s in seqs]
    for i, o in enumerate(outs):
        assert o == expected_output(prompt, SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=6))
    assert len({tuple(o) for o in outs}) == 4
    assert_idle_and_clean(eng)


def test_engine_abort_first_sequence_before_the_fork_releases_its_siblings():
    eng = make_engine(64, budget=4)  # a 14-token prompt takes 4 steps
    prompt = toks(14, 8)
    seqs = submit(eng, "a", prompt, n=3, max_tokens=4)

    def abort_first(e, i):
        if i == 2:
            e.abort("a#0")

    run(eng, on_step=abort_first)
    assert eng.outbox.published["a#0"].finish_reason == "abort"
    single = expected_output(prompt, seqs[0].sampling)
    assert output(eng, "a#1") == output(eng, "a#2") == single
    assert_idle_and_clean(eng)


def test_engine_abort_a_sibling_still_waiting_for_the_fork():
    eng = make_engine(64, budget=4)
    prompt = toks(14, 8)
    submit(eng, "a", prompt, n=3, max_tokens=4)

    def abort_sibling(e, i):
        if i == 1:
            assert "a#0" in e.core.forks
            e.abort("a#2")

    run(eng, on_step=abort_sibling)
    assert eng.outbox.published["a#2"].finish_reason == "abort" and eng.outbox.published["a#2"].token_ids == []
    assert output(eng, "a#0") == output(eng, "a#1")
    assert_idle_and_clean(eng)


def test_engine_fork_over_max_num_seqs_queues_siblings():
    eng = make_engine(64, max_seqs=2)
    prompt = toks(9, 3)
    seqs = submit(eng, "m", prompt, n=4, max_tokens=3)
    run(eng)
    single = expected_output(prompt, seqs[0].sampling)
    assert all(output(eng, s.request_id) == single for s in seqs)
    assert_idle_and_clean(eng)


def test_engine_ping_with_a_new_worker_epoch_drops_the_cache():
    """A worker restarted while the scheduler idles: its KV is gone, so no cached block may be hit afterwards."""
    eng = make_engine(32)
    p = toks(13, 5)
    submit(eng, "a", p)
    run(eng)
    assert eng.core.pool.index
    eng.fake_worker = FakeWorker(32, BS, epoch="e2")  # same address, new process: empty KV
    eng.worker.stub = FakeStub(eng.fake_worker)
    eng._check_worker()  # the idle loop notices the new epoch
    b = submit(eng, "b", p)[0]
    run(eng)  # the fake worker asserts if a stale block is read
    assert b.num_cached_tokens == 0
    assert output(eng, "b") == expected_output(p, b.sampling)
    assert_idle_and_clean(eng)


def test_engine_preemption_of_requests_holding_shared_blocks():
    eng = make_engine(12, budget=16)
    prefix = toks(12, 21)  # 3 full blocks
    first = submit(eng, "w", prefix + [3, 4], max_tokens=2)[0]
    run(eng)
    reqs = [submit(eng, f"p{i}", prefix + toks(3, 30 + i), max_tokens=14)[0] for i in range(3)]
    sharing: dict[str, int] = {}  # request id -> its preemption count when last seen holding a shared block
    preempted_while_sharing = []

    def watch(e, it):
        for r in reqs:
            if r.request_id in sharing and r.num_preemptions > sharing.pop(r.request_id):
                preempted_while_sharing.append(r.request_id)
        for r in e.core.running:
            if any(e.core.pool.ref_counts[b] > 1 for b in r.block_ids):
                sharing[r.request_id] = r.num_preemptions

    run(eng, on_step=watch)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert preempted_while_sharing, "a request holding shared prefix blocks must have been preempted"
    for r in [first, *reqs]:
        assert output(eng, r.request_id) == expected_output(r.prompt_ids, r.sampling)
    assert all(r.num_cached_tokens == 12 for r in reqs if r.num_preemptions == 0)
    assert_idle_and_clean(eng)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_engine_randomized_shared_prefixes_forks_aborts_and_preemption(caching, seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([10, 14, 20])
    eng = make_engine(num_blocks, caching=caching, budget=rng.choice([8, 16, 32]), max_seqs=rng.choice([3, 6, 8]))
    prefixes = [toks(rng.randint(4, 14), 50 + i) for i in range(3)]
    specs = []
    for i in range(24):
        prompt = rng.choice(prefixes)[: rng.randint(1, 14)] + toks(rng.randint(0, 6), 100 + i)
        if not prompt:
            prompt = toks(1, 100 + i)
        n = rng.choice([1, 1, 1, 2, 4])
        specs.append(dict(rid=f"r{i}", prompt=prompt, n=n, temperature=rng.choice([0.0, 0.7]),
                          seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, 12),
                          salt=rng.choice(["", "", "t"]), at=rng.randint(0, 30)))
    aborts = {f"r{i}" + rng.choice(["", "#0", "#1"]): rng.randint(0, 40) for i in rng.sample(range(24), 6)}
    reqs: dict[str, Request] = {}

    def feed(e, it):
        for s in specs:
            if s["at"] == it:
                for r in submit(e, s["rid"], s["prompt"], n=s["n"], temperature=s["temperature"], seed=s["seed"],
                                max_tokens=s["max_tokens"], salt=s["salt"]):
                    reqs[r.request_id] = r
        for rid, at in aborts.items():
            if at == it and rid in e.outbox.published:
                e.abort(rid)

    it = 0
    while it < 100 or any(s["at"] >= it for s in specs):  # keep going until every spec was submitted
        feed(eng, it)
        it += 1
        if eng.core.running or eng.core.waiting or eng.core.forks or eng.inbox:
            eng._iteration()
    run(eng)
    for rid, r in reqs.items():
        pub = eng.outbox.published[rid]
        assert pub.finish_reason in ("length", "abort"), (rid, pub.finish_reason)
        want = expected_output(r.prompt_ids, r.sampling)
        if pub.finish_reason == "length":
            assert pub.token_ids == want, rid
        else:
            assert pub.token_ids == want[: len(pub.token_ids)], rid
    assert_idle_and_clean(eng)
    if caching:
        assert hit_tokens(eng) > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_stop_token_finishes_with_the_next_step_already_planned(async_scheduling):
    """A stop token ends a request the pipelined scheduler has already planned for the next step: the worker skips
    that entry, the extra slot is released, no token after the stop is published, and no block leaks."""
    eng = make_engine(24, budget=16)
    eng.cfg.async_scheduling = async_scheduling
    want = {}
    for i in range(6):
        prompt = toks(5 + i, 40 + i)
        full = expected_output(prompt, SamplingParams(temperature=0.0, max_tokens=12))
        stop_at = 2 + i % 4
        want[f"s{i}"] = full[: stop_at + 1]
        submit(eng, f"s{i}", prompt, max_tokens=12, stop_token_ids=(full[stop_at],))
    run(eng)
    for rid, tokens in want.items():
        assert output(eng, rid) == tokens and eng.outbox.published[rid].finish_reason == "stop"
    assert_idle_and_clean(eng)
