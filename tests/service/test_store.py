"""RedisLedger against a real redis-server: lease and fencing, atomic step commits, reload, invariants."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import redis

from common.sampling_fields import SamplingParams
from scheduler_svc.core.block_pool import BlockPool, BlockState
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.request import FINISH_LENGTH, Request, Status
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.step_records import WORKER_MAX_TOKENS, Logprobs, SampledToken, WorkerOutput
from scheduler_svc.ledger.store import (
    InvariantViolation,
    LeaseLost,
    LedgerBehind,
    RedisLedger,
    SchemaMismatch,
    StepCommit,
)

HOLDER = "sched-a"
TTL_MS = 5000


def refs(counts: dict[int, int]) -> dict[int, BlockState]:
    """Block changes without prefix-cache content."""
    return {b: BlockState(n) for b, n in counts.items()}


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis.Redis.from_url(redis_server)
    c.flushdb()
    yield c
    c.close()


@pytest.fixture
def ledger(client) -> RedisLedger:
    led = RedisLedger(client, namespace="t")
    led.init_pool(num_blocks=16, block_size=4)
    return led


def make_request(rid: str, prompt_len: int = 5, max_tokens: int = 4, seq: int = 0, **kw) -> Request:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=1234 + seq, max_tokens=max_tokens, stop_token_ids=[2, 7])
    return Request(request_id=rid, prompt_ids=list(range(100 + seq, 100 + seq + prompt_len)), sampling=sampling,
                   arrival_time=1000.0 + seq / 3, arrival_seq=seq, **kw)


def snapshot(c: redis.Redis) -> dict:
    """Every key's value, to show a rejected commit changed nothing."""
    out = {}
    for key in c.keys("*"):
        kind = c.type(key)
        if kind == b"string":
            out[key] = c.get(key)
        elif kind == b"hash":
            out[key] = c.hgetall(key)
        elif kind == b"set":
            out[key] = c.smembers(key)
        out[(key, "ttl")] = c.pttl(key) > 0
    return out


# ---- lease ------------------------------------------------------------------------------------------------


def test_lease_acquire_renew_expire_takeover(ledger):
    t1 = ledger.try_acquire_lease(HOLDER, 150)
    assert t1 == 1
    assert ledger.try_acquire_lease(HOLDER, 150) == t1  # re-acquiring our own lease: same token
    assert ledger.try_acquire_lease("sched-b", 150) is None
    assert ledger.renew_lease(HOLDER, t1, 150)
    assert not ledger.renew_lease(HOLDER, t1 + 1, 150)
    time.sleep(0.3)  # lapse
    assert not ledger.renew_lease(HOLDER, t1, 150)
    t2 = ledger.try_acquire_lease("sched-b", TTL_MS)
    assert t2 is not None and t2 > t1
    assert ledger.try_acquire_lease(HOLDER, TTL_MS) is None
    with pytest.raises(LeaseLost):
        ledger.commit_step(HOLDER, t1, TTL_MS, StepCommit(step_id=1, arrival_seq=0))
    ledger.release_lease(HOLDER, t1)  # not ours any more: a no-op
    assert ledger.try_acquire_lease(HOLDER, TTL_MS) is None
    ledger.release_lease("sched-b", t2)
    t3 = ledger.try_acquire_lease(HOLDER, TTL_MS)
    assert t3 > t2


def test_commit_renews_lease(ledger, client):
    tok = ledger.try_acquire_lease(HOLDER, 200)
    ledger.commit_step(HOLDER, tok, 60_000, StepCommit(step_id=1, arrival_seq=0))
    assert client.pttl(ledger.k_lease) > 10_000


def test_stale_token_commit_raises_and_changes_nothing(ledger, client):
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    ledger.release_lease(HOLDER, tok)
    new_tok = ledger.try_acquire_lease("sched-b", TTL_MS)
    before = snapshot(client)
    req = make_request("r1", status=Status.RUNNING, block_ids=[0, 1])
    commit = StepCommit(step_id=1, arrival_seq=1, new_requests=[req], appended={"r1": [5]},
                        block_changes=refs({0: 1, 1: 1}))
    with pytest.raises(LeaseLost):
        ledger.commit_step(HOLDER, tok, TTL_MS, commit)
    with pytest.raises(LeaseLost):  # right token, wrong holder
        ledger.commit_step(HOLDER, new_tok, TTL_MS, commit)
    assert snapshot(client) == before


def test_commit_after_a_step_the_ledger_lacks_raises_and_changes_nothing(ledger, client):
    # A promoted replica that missed the last commits: step 2 follows step 3, which the ledger never got.
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    req = make_request("r1", status=Status.RUNNING, block_ids=[0])
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(step_id=2, arrival_seq=1, new_requests=[req],
                                                       appended={"r1": [5]}, block_changes=refs({0: 1}),
                                                       after_step_id=0))
    before = snapshot(client)
    with pytest.raises(LedgerBehind, match="holds step 2, this commit follows step 3"):
        ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(step_id=4, arrival_seq=1, appended={"r1": [7]},
                                                           after_step_id=3))
    assert snapshot(client) == before
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(step_id=3, arrival_seq=1, updated=[req], appended={"r1": [6]},
                                                       after_step_id=2))
    assert client.hget(ledger.k_meta, "step_id") == b"3"


def test_set_worker_is_fenced_and_returns_previous_epoch(ledger, client):
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    assert ledger.set_worker(tok, "10.0.0.1:50051", "epoch-1", {"num_blocks": "16", "model": "m"}) is None
    assert ledger.set_worker(tok, "10.0.0.1:50051", "epoch-2", {"num_blocks": "16"}) == "epoch-1"
    meta = ledger.load().meta
    assert meta["worker_epoch"] == "epoch-2" and meta["worker_address"] == "10.0.0.1:50051"
    assert "worker_model" not in meta  # the old worker's info is gone
    assert meta["num_blocks"] == "16"  # worker info never clobbers the pool's own fields
    with pytest.raises(LeaseLost):
        ledger.set_worker(tok + 1, "x", "epoch-3", {})
    assert client.hget(ledger.k_meta, "worker_epoch") == b"epoch-2"


# ---- pool -------------------------------------------------------------------------------------------------


def test_init_pool_once_and_shape_mismatch(client):
    led = RedisLedger(client, namespace="t")
    assert led.init_pool(8, 16)
    assert not led.init_pool(8, 16)
    assert led.check_ledger() == {"free": 8, "evictable": 0, "allocated": 0, "total": 8, "refs_sum": 0, "cached": 0,
                                  "active": 0, "overlap": 0}
    with pytest.raises(ValueError, match=r"num_blocks=8.*block_size=16.*num_blocks=9.*block_size=16"):
        led.init_pool(9, 16)
    with pytest.raises(ValueError, match=r"block_size=32"):
        led.init_pool(8, 32)


def test_invariant_check_detects_corruption_and_writes_nothing(ledger, client):
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    ok = StepCommit(step_id=1, arrival_seq=0, block_changes=refs({3: 1}), check_invariant=True)
    ledger.commit_step(HOLDER, tok, TTL_MS, ok)

    before = snapshot(client)
    with pytest.raises(InvariantViolation, match="outside"):
        ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(2, 0, block_changes=refs({16: 1}), check_invariant=True))
    assert snapshot(client) == before

    client.srem(ledger.k_free, 5)  # a block lost by someone else
    before = snapshot(client)
    with pytest.raises(InvariantViolation, match="free 15 \\+ evictable 0 \\+ allocated 0 ~= total 16"):
        ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(2, 0, block_changes=refs({3: 0}), check_invariant=True))
    assert snapshot(client) == before
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(2, 0, block_changes=refs({3: 0})))  # unchecked: goes through
    assert ledger.check_ledger()["free"] == 15


# ---- commits and reload -----------------------------------------------------------------------------------


class MiniEngine:
    """The real scheduler core with a fake worker's tokens, committing every step to the ledger like the driver."""

    def __init__(self, ledger: RedisLedger, token: int, num_blocks: int, block_size: int):
        self.ledger, self.token = ledger, token
        self.core = SchedulerCore(PolicyConfig(max_num_batched_tokens=12, max_num_seqs=4, block_size=block_size,
                                                enable_prefix_caching=False),
                                  BlockPool(num_blocks))
        self.pool, self.waiting, self.running = self.core.pool, self.core.waiting, self.core.running
        self.finished: list[Request] = []
        self.step_id = 0
        self.copies = 0

    @property
    def arrival_seq(self) -> int:
        return self.core.arrival_seq

    def step(self, arrivals: list[Request], groups: list[list[Request]] = ()) -> None:
        """One step; `groups`: requests with n > 1 (the first, then siblings that fork from it)."""
        self.step_id += 1
        for r in arrivals:
            self.core.add([r])
        for g in groups:
            self.core.add(g)
        out = self.core.schedule(0.0)
        self.copies += len(out.copies)
        tokens = []
        for r in out.scheduled:
            if r.num_pending_tokens:  # the chunk reached the end of the known tokens: the worker samples one
                tok = (sum(map(ord, r.request_id)) * 31 + r.num_tokens) % 50_000
                finish = WORKER_MAX_TOKENS if len(r.output_ids) + 1 >= r.max_tokens else None
                tokens.append(SampledToken(r.request_id, tok, finish))
        outcome = self.core.update_from_output(out, WorkerOutput(tokens), 2000.0 + self.step_id / 7)
        self.core.check_invariant()
        commit = self.core.take_commit(self.step_id, out, outcome, check_invariant=True)
        self.finished += commit.finished
        self.ledger.commit_step(HOLDER, self.token, TTL_MS, commit)

    @property
    def unfinished(self) -> list[Request]:
        return sorted([*self.waiting, *self.running], key=lambda r: r.arrival_seq)


def test_commit_sequence_then_load_rebuilds_state(client, redis_server):  # noqa: F811
    ledger = RedisLedger(client, namespace="seq")
    ledger.init_pool(num_blocks=10, block_size=4)  # tight: forces preemptions
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    eng = MiniEngine(ledger, tok, num_blocks=10, block_size=4)
    # Ids a client might send: separators, braces (must not break the hash tag), non-ASCII.
    rids = ["a", "b:1", "c{x}", "d é", "e,f", "g\"h", "i"]
    arrivals = {0: [0, 1, 2], 1: [3], 3: [4, 5], 6: [6]}
    step = 0
    while step < 100 and (step <= max(arrivals) or eng.waiting or eng.running):
        new = [make_request(rids[i], prompt_len=5 + 2 * i, max_tokens=6 + i % 4, seq=i, priority=i % 2,
                            stop=["\n\n", "END"] if i % 2 else [], include_stop_str_in_output=i == 3,
                            skip_special_tokens=i != 4)
               for i in arrivals.get(step, [])]
        eng.step(new)
        step += 1
        # A fresh process on a fresh connection sees exactly the mirror.
        with redis.Redis.from_url(redis_server) as c2:
            state = RedisLedger(c2, namespace="seq").load()
        assert state.requests == eng.unfinished
        assert state.pool.ref_counts == eng.pool.ref_counts
        assert sorted(state.pool.free) == sorted(eng.pool.free)
        assert (state.step_id, state.arrival_seq) == (eng.step_id, eng.arrival_seq)
        led = ledger.check_ledger()
        assert led["free"] + led["allocated"] == led["total"] == 10 and led["overlap"] == 0

    assert not eng.waiting and not eng.running and len(eng.finished) == len(rids)
    assert sum(r.num_preemptions for r in eng.finished) > 0, "the pool was meant to be tight enough to preempt"
    assert client.scard(ledger.k_active) == 0
    for r in eng.finished:
        got = ledger.get_request(r.request_id)
        assert got == r and got.finish_reason == FINISH_LENGTH and len(got.output_ids) == r.max_tokens
        assert 0 < client.ttl(ledger.prefix + "req:" + r.request_id) <= 600
        assert 0 < client.ttl(ledger.prefix + f"out:{r.arrival_seq}") <= 600
        assert not client.exists(ledger.prefix + f"blk:{r.arrival_seq}")
        assert not client.hexists(ledger.prefix + "computed", r.arrival_seq)
    assert ledger.get_request("nope") is None


def test_load_after_forks_copy_on_write_preemption_and_finish_equals_memory(client, redis_server):  # noqa: F811
    """Deltas (appended block ids, whole tables on copy-on-write and preemption) read back to the same state."""
    ledger = RedisLedger(client, namespace="cow")
    ledger.init_pool(num_blocks=10, block_size=4)  # tight: forces preemptions
    eng = MiniEngine(ledger, ledger.try_acquire_lease(HOLDER, TTL_MS), num_blocks=10, block_size=4)
    groups = {0: [0, 3], 2: [6], 4: [9, 12]}  # first sequence ids; each with two siblings (n = 3)
    step = 0
    while step < 150 and (step <= max(groups) or eng.waiting or eng.running):
        batch = []
        for g in groups.get(step, []):
            first = make_request(f"g{g}#0", prompt_len=6 + g % 3, max_tokens=9 + g % 4, seq=g)
            batch.append([first] + [make_request(f"g{g}#{i}", prompt_len=first.num_prompt_tokens,
                                                 max_tokens=first.max_tokens, seq=g + i, fork_of=first.request_id)
                                    for i in (1, 2)])
            for sib in batch[-1][1:]:
                sib.prompt_ids = list(first.prompt_ids)
        eng.step([], batch)
        step += 1
        with redis.Redis.from_url(redis_server) as c2:
            state = RedisLedger(c2, namespace="cow").load()
        # Siblings waiting to fork are in neither queue yet.
        assert state.requests == sorted(eng.core.requests.values(), key=lambda r: r.arrival_seq)
        assert state.pool.ref_counts == eng.pool.ref_counts and sorted(state.pool.free) == sorted(eng.pool.free)
    assert not eng.waiting and not eng.running and len(eng.finished) == 15
    assert eng.copies > 0, "siblings were meant to copy a shared block"
    assert sum(r.num_preemptions for r in eng.finished) > 0, "the pool was meant to be tight enough to preempt"
    for r in eng.finished:
        assert ledger.get_request(r.request_id) == r


def _server_commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_evalsha"))


def test_decode_step_costs_one_command_per_request(client):
    """A decode step appends each request's token (one APPEND each); the rest is a fixed handful of commands."""
    cost = {}
    for n in (1, 10):
        led = RedisLedger(client, namespace=f"cmd{n}")
        led.init_pool(n * 32, 16)
        tok = led.try_acquire_lease(HOLDER, TTL_MS)
        reqs = _big_step(led, tok, n=n)
        led.commit_step(HOLDER, tok, TTL_MS, _decode_commit(reqs, 2))
        before = _server_commands(client)
        led.commit_step(HOLDER, tok, TTL_MS, _decode_commit(reqs, 3))
        cost[n] = _server_commands(client) - before
        assert led.get_request(reqs[-1].request_id) == reqs[-1]
    assert cost[10] - cost[1] == 9
    assert cost[1] <= 6  # lease check, num_computed, the token, step id, lease renewal


def test_pool_of_schema_version_2_is_refused(client):
    """A pool the previous layout wrote (state rewritten each step, text outputs keyed by request id)."""
    client.hset("v2:{0}:meta", mapping={"schema_version": 2, "num_blocks": 4, "block_size": 16})
    led = RedisLedger(client, namespace="v2")
    for call in (lambda: led.init_pool(4, 16), led.load):
        with pytest.raises(SchemaMismatch, match="schema_version 2"):
            call()


def test_finished_request_leaves_active_but_stays_readable(ledger, client):
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    r = make_request("r1", status=Status.RUNNING, block_ids=[0, 1], num_computed_tokens=5)
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(1, 1, new_requests=[r], appended={"r1": [11]},
                                                       block_changes=refs({0: 1, 1: 1})))
    r.output_ids = [11]
    assert client.sismember(ledger.k_active, "r1")
    # Finish in the same step as a token is appended; the token still lands and expires with the request.
    r.output_ids.append(12)
    r.status, r.finish_reason, r.block_ids = Status.FINISHED, "stop", []
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(2, 1, appended={"r1": [12]}, finished=[r],
                                                       block_changes=refs({0: 0, 1: 0}), finished_ttl_s=30))
    assert not client.sismember(ledger.k_active, "r1")
    assert ledger.load().requests == []
    got = ledger.get_request("r1")
    assert got == r and got.output_ids == [11, 12] and got.status == Status.FINISHED
    assert 0 < client.ttl(ledger.prefix + f"out:{r.arrival_seq}") <= 30
    assert ledger.check_ledger() == {"free": 16, "evictable": 0, "allocated": 0, "total": 16, "refs_sum": 0,
                                     "cached": 0, "active": 0, "overlap": 0}

    # A reused id starts clean: no old outputs, no TTL.
    again = make_request("r1", seq=9)
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(3, 2, new_requests=[again]))
    assert ledger.get_request("r1") == again
    assert client.ttl(ledger.prefix + "req:r1") == -1


def test_block_tables_rewritten_after_lease_changes_hands(ledger, client):
    # commit_step skips unchanged block tables; that memory must not outlive the lease it was written under.
    t1 = ledger.try_acquire_lease(HOLDER, TTL_MS)
    r = make_request("r", status=Status.RUNNING, block_ids=[0])
    ledger.commit_step(HOLDER, t1, TTL_MS, StepCommit(1, 1, new_requests=[r], block_changes=refs({0: 1})))
    ledger.release_lease(HOLDER, t1)

    other = RedisLedger(client, namespace="t")
    t2 = other.try_acquire_lease("sched-b", TTL_MS)
    moved = dataclasses.replace(r, block_ids=[1])
    other.commit_step("sched-b", t2, TTL_MS, StepCommit(2, 1, updated=[moved], block_changes=refs({0: 0, 1: 1})))
    other.release_lease("sched-b", t2)

    t3 = ledger.try_acquire_lease(HOLDER, TTL_MS)
    ledger.commit_step(HOLDER, t3, TTL_MS, StepCommit(3, 1, updated=[r], block_changes=refs({1: 0, 0: 1}),
                                                      check_invariant=True))
    assert ledger.get_request("r").block_ids == [0]
    assert ledger.load().pool.ref_counts[:2] == [1, 0]


def test_namespaces_and_pools_isolate(client):
    a = RedisLedger(client, namespace="ns1")
    b = RedisLedger(client, namespace="ns2")
    c = RedisLedger(client, namespace="ns1", pool="1")
    for led in (a, b, c):
        led.init_pool(8, 16)
    ta, tb = a.try_acquire_lease(HOLDER, TTL_MS), b.try_acquire_lease(HOLDER, TTL_MS)
    assert ta == tb == 1 and c.try_acquire_lease(HOLDER, TTL_MS) == 1  # independent leases and fences
    r = make_request("same-id", status=Status.RUNNING, block_ids=[0])
    a.commit_step(HOLDER, ta, TTL_MS, StepCommit(1, 1, new_requests=[r], appended={"same-id": [3]},
                                                 block_changes=refs({0: 1})))
    assert b.get_request("same-id") is None and c.get_request("same-id") is None
    assert b.check_ledger()["free"] == c.check_ledger()["free"] == 8
    assert a.check_ledger()["free"] == 7
    assert all(k.startswith(b"ns1:{0}:") or k.startswith(b"ns2:{0}:") or k.startswith(b"ns1:{1}:")
               for k in client.keys("*"))
    a.flush_pool()
    assert client.keys("ns1:{0}:*") == []
    assert b.load().step_id == 0 and c.check_ledger()["total"] == 8
    with pytest.raises(ValueError):
        RedisLedger(client, namespace="bad{ns}")


def test_decoded_responses_client_works(redis_server):  # noqa: F811
    with redis.Redis.from_url(redis_server, decode_responses=True) as c:
        c.flushdb()
        led = RedisLedger(c, namespace="dec")
        led.init_pool(4, 16)
        tok = led.try_acquire_lease(HOLDER, TTL_MS)
        r = make_request("x", status=Status.RUNNING, block_ids=[2])
        led.commit_step(HOLDER, tok, TTL_MS, StepCommit(1, 1, new_requests=[r], appended={"x": [1, 2]},
                                                       block_changes=refs({2: 1})))
        r.output_ids = [1, 2]
        state = led.load()
        assert state.requests == [r] and state.pool.ref_counts == [0, 0, 1, 0]
        assert led.get_request("x") == r
        assert led.set_worker(tok, "a", "e1", {}) is None and led.set_worker(tok, "a", "e2", {}) == "e1"


# ---- cost -------------------------------------------------------------------------------------------------


def test_output_logprobs_are_stored_with_their_tokens_and_read_back_bit_equal(ledger, client):
    """A request that asked for logprobs: each commit appends its tokens' logprobs (float32, as the worker sent
    them) beside the tokens, in the same round trip; load() and get_request() give them back, and they expire with
    the output. A request that did not ask stores none."""
    tok = ledger.try_acquire_lease(HOLDER, TTL_MS)
    asked = make_request("lp", status=Status.RUNNING, block_ids=[0], num_computed_tokens=5)
    asked.sampling.logprobs = 2
    plain = make_request("plain", seq=1, status=Status.RUNNING, block_ids=[1], num_computed_tokens=5)
    f32 = [-0.125, -1.5, -3.0517578125e-05, float("-inf"), -17.25]  # values a float32 holds exactly
    first = [Logprobs(f32[0], [(11, f32[0]), (40, f32[1])]), Logprobs(f32[2], [(12, f32[2]), (7, f32[3])])]
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(1, 2, new_requests=[asked, plain],
                                                       appended={"lp": [11, 12], "plain": [5]},
                                                       logprobs={"lp": first}, block_changes=refs({0: 1, 1: 1})))
    later = [None, Logprobs(f32[4], [(13, f32[4]), (0, f32[1])])]  # a token without logprobs keeps its place
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(2, 2, appended={"lp": [99, 13]}, logprobs={"lp": later}))
    loaded = {r.request_id: r for r in ledger.load().requests}
    assert loaded["lp"].output_ids == [11, 12, 99, 13]
    assert loaded["lp"].output_logprobs == first + later
    assert loaded["plain"].output_logprobs is None
    assert not client.exists(ledger.prefix + f"lp:{plain.arrival_seq}")
    # 8 bytes per token plus 8 per top logprob.
    assert client.strlen(ledger.prefix + f"lp:{asked.arrival_seq}") == 3 * (8 + 2 * 8) + 8
    asked.status, asked.finish_reason, asked.block_ids = Status.FINISHED, "length", []
    asked.output_ids = [11, 12, 99, 13]
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(3, 2, finished=[asked], block_changes=refs({0: 0}),
                                                       finished_ttl_s=30))
    assert ledger.get_request("lp").output_logprobs == first + later
    assert 0 < client.ttl(ledger.prefix + f"lp:{asked.arrival_seq}") <= 30
    # A reused id starts without the old logprobs.
    again = make_request("lp", seq=2)
    again.sampling.logprobs = 0
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(4, 3, new_requests=[again]))
    assert ledger.get_request("lp").output_logprobs == []


def _big_step(ledger: RedisLedger, tok: int, n: int = 256, blocks_each: int = 32) -> list[Request]:
    reqs = []
    for i in range(n):
        r = make_request(f"req-{i}", prompt_len=blocks_each * 16 - 8, max_tokens=256, seq=i, status=Status.RUNNING,
                         block_ids=list(range(i * blocks_each, (i + 1) * blocks_each)))
        r.num_computed_tokens = r.num_tokens
        reqs.append(r)
    changes = refs({b: 1 for r in reqs for b in r.block_ids})
    ledger.commit_step(HOLDER, tok, TTL_MS, StepCommit(1, n, new_requests=reqs, block_changes=changes))
    return reqs


def _decode_commit(reqs: list[Request], step_id: int) -> StepCommit:
    appended = {}
    for r in reqs:
        r.output_ids.append(step_id % 1000)
        r.num_computed_tokens += 1
        appended[r.request_id] = [step_id % 1000]
    return StepCommit(step_id, len(reqs), updated=reqs, appended=appended)


def test_one_round_trip_per_commit(client):
    led = RedisLedger(client, namespace="rt")
    led.init_pool(256 * 32, 16)
    tok = led.try_acquire_lease(HOLDER, TTL_MS)
    reqs = _big_step(led, tok)  # also loads the script on the server
    probe = redis.Redis(connection_pool=client.connection_pool)

    def calls() -> dict[str, int]:
        return {k: v["calls"] for k, v in probe.info("commandstats").items()}

    before = calls()
    led.commit_step(HOLDER, tok, TTL_MS, _decode_commit(reqs, 2))
    after = calls()
    # Only the EVALSHA reached the server from the client (the first INFO call itself shows up too).
    client_cmds = {k: after[k] - before.get(k, 0) for k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script")
                   if k in after and after[k] != before.get(k, 0)}
    assert client_cmds == {"cmdstat_evalsha": 1}


def test_256_running_requests_commit_in_one_round_trip_per_step(client, capsys):
    """50 decode steps of 256 requests: each commit is one EVALSHA, never a fallback to EVAL or SCRIPT LOAD (the
    ledger's reads and writes run inside it). The time per commit is printed, not asserted."""
    led = RedisLedger(client, namespace="perf")
    led.init_pool(256 * 32, 16)
    tok = led.try_acquire_lease(HOLDER, TTL_MS)
    reqs = _big_step(led, tok)
    probe = redis.Redis(connection_pool=client.connection_pool)
    stats = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script")  # commands the script runs count too: not those

    def calls() -> dict[str, int]:
        return {k: v["calls"] for k, v in probe.info("commandstats").items() if k in stats}

    times = []
    before = calls()
    for step_id in range(2, 52):
        commit = _decode_commit(reqs, step_id)
        t0 = time.perf_counter()
        led.commit_step(HOLDER, tok, TTL_MS, commit)
        times.append(time.perf_counter() - t0)
    after = calls()
    with capsys.disabled():
        print(f"\ncommit_step, 256 running requests x 1 token, 32 blocks each: median "
              f"{statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")
    assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {"cmdstat_evalsha": 50}
    assert led.get_request("req-7").output_ids == list(range(2, 52))
