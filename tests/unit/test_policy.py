"""Unit tests for the pure scheduling policy (scheduler_svc/core/policy.py) and its block pool.

The policy does not advance `num_computed_tokens` nor append output tokens: the scheduler core does that
after the worker step (`SchedulerCore.update_from_output`). `Engine.step` below runs the real core and fakes only
the worker (one fake token per request whose scheduled chunk reached the end of its known tokens; the worker's
max_tokens finish at `max_tokens` outputs).
"""

from __future__ import annotations

import random

import pytest

from common.sampling_fields import SamplingParams
from scheduler_svc.core.block_pool import BlockPool, NoFreeBlocks
from scheduler_svc.core.policy import PolicyConfig, blocks_for
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.step_records import WORKER_MAX_TOKENS, SampledToken, SchedulerOutput, WorkerOutput


def make_req(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, seq: int = 0) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=[(seq * 31 + i) % 1000 + 1 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_seq=seq,
    )


def fake_token(req: Request) -> int:
    return 10_000 + len(req.output_ids)


class Engine:
    """The real scheduler core against a fake worker, checking the policy's contract every step."""

    def __init__(self, cfg: PolicyConfig, num_blocks: int):
        self.cfg = cfg
        self.core = SchedulerCore(cfg, BlockPool(num_blocks))
        self.pool, self.waiting, self.running = self.core.pool, self.core.waiting, self.core.running
        self.finished: list[Request] = []
        self._seq = 0
        self.steps = 0

    def add(self, rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Request:
        req = make_req(rid, prompt_len, max_tokens, priority, self._seq)
        self._seq += 1
        self.core.add([req])
        return req

    def add_running(
        self, rid: str, prompt_len: int, computed: int, outputs: int = 0, max_tokens: int = 100, priority: int = 0
    ) -> Request:
        """A request already running: `computed` tokens in the KV cache, `outputs` tokens generated."""
        req = self.add(rid, prompt_len, max_tokens, priority)
        self.waiting.remove(req)
        req.output_ids = [fake_token(req) for _ in range(outputs)]
        assert computed <= req.num_tokens
        req.num_computed_tokens = computed
        req.block_ids = self.pool.allocate(blocks_for(computed, self.cfg.block_size))
        req.status = Status.RUNNING
        self.running.append(req)
        return req

    def ids(self, reqs) -> list[str]:
        return [r.request_id for r in reqs]

    def step(self) -> SchedulerOutput:
        self.steps += 1
        assert self.steps < 5000, "runaway simulation"
        running_before = list(self.running)
        waiting_before = list(self.waiting)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        out = self.core.schedule(now=0.0)
        self.check_step(out, running_before, waiting_before, computed_before)
        # The worker's part: a token for each chunk that reaches the end of the known tokens; max_tokens ends it.
        tokens = []
        for req in out.scheduled:
            assert req.num_computed_tokens <= req.num_tokens
            if req.num_pending_tokens:  # the chunk reached the end of the known tokens: the worker samples one
                done = len(req.output_ids) + 1 >= req.max_tokens
                tokens.append(SampledToken(req.request_id, fake_token(req), WORKER_MAX_TOKENS if done else None))
        self.core.update_from_output(out, WorkerOutput(tokens), now=0.0)
        self.finished += self.core.take_commit(self.steps).finished
        self.check_state()
        return out

    def check_step(self, out: SchedulerOutput, running_before, waiting_before, computed_before) -> None:
        cfg = self.cfg
        sched_ids = self.ids(out.scheduled)
        assert len(set(sched_ids)) == len(sched_ids), "a request scheduled twice"
        assert set(sched_ids) == set(out.num_tokens) == set(out.new_blocks)
        assert all(n > 0 for n in out.num_tokens.values())
        assert out.total_tokens <= cfg.max_num_batched_tokens
        if cfg.long_prefill_token_threshold > 0:
            assert all(n <= cfg.long_prefill_token_threshold for n in out.num_tokens.values())
        assert len(self.running) <= cfg.max_num_seqs
        # Plan order: the (surviving) running requests in their order, then the admitted ones.
        k = len(out.scheduled) - len(out.admitted)
        assert out.scheduled[k:] == out.admitted
        before_pos = {r.request_id: i for i, r in enumerate(running_before)}
        assert all(r.request_id in before_pos for r in out.scheduled[:k])
        positions = [before_pos[r.request_id] for r in out.scheduled[:k]]
        assert positions == sorted(positions), "running requests not scheduled in order"
        # Preemption: freed, reset, in waiting, not scheduled, nothing admitted.
        pre_ids = self.ids(out.preempted)
        assert len(set(pre_ids)) == len(pre_ids)
        for v in out.preempted:
            assert v.request_id in before_pos
            assert v.request_id not in out.num_tokens
            assert v.status == Status.WAITING and v.num_computed_tokens == 0 and v.block_ids == []
            assert v in self.waiting and v not in self.running
        if out.preempted:
            assert out.admitted == []
        # Admission order: fcfs takes the queue's head; priority takes the best (priority, arrival).
        if out.admitted:
            expect = list(waiting_before)
            if cfg.scheduling_policy == "priority":
                expect.sort(key=lambda r: (r.priority, r.arrival_seq))
            assert self.ids(out.admitted) == self.ids(expect[: len(out.admitted)])
        # Work conservation: a surviving running request is skipped only when the budget is spent.
        skipped = [r for r in running_before if r.request_id not in out.num_tokens and r not in out.preempted]
        if skipped:
            assert out.total_tokens == cfg.max_num_batched_tokens
        # Blocks: exactly what the computed-plus-scheduled tokens need; new ones are the table's tail.
        for req in out.scheduled:
            n = out.num_tokens[req.request_id]
            base = computed_before.get(req.request_id, 0)
            # The core advances a scheduled request at once (so the next step can be planned while this one runs).
            assert base == out.num_computed_before[req.request_id] and req.num_computed_tokens == base + n
            assert len(req.block_ids) == blocks_for(base + n, cfg.block_size)
            new = out.new_blocks[req.request_id]
            assert req.block_ids[len(req.block_ids) - len(new) :] == new
        self.pool.check([r.block_ids for r in self.running])

    def check_state(self) -> None:
        self.pool.check([r.block_ids for r in self.running])
        for r in self.running:
            assert r.status == Status.RUNNING
            assert len(r.block_ids) == blocks_for(r.num_computed_tokens, self.cfg.block_size)
        for r in self.waiting:
            assert r.status == Status.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
        ids = self.ids(self.running) + self.ids(self.waiting) + self.ids(self.finished)
        assert len(ids) == len(set(ids)), "a request is in two places"


def cfg_(**kw) -> PolicyConfig:
    base = dict(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, enable_prefix_caching=False)
    base.update(kw)
    return PolicyConfig(**base)


# ---------------------------------------------------------------- budget, ordering, chunked prefill


def test_decodes_before_waiting_and_budget_filled_by_a_chunk():
    e = Engine(cfg_(max_num_batched_tokens=8), num_blocks=64)
    decs = [e.add_running(f"d{i}", 5, computed=5, outputs=1) for i in range(3)]
    long = e.add("long", 100)
    out = e.step()
    assert out.scheduled == decs + [long]
    assert [out.num_tokens[d.request_id] for d in decs] == [1, 1, 1]
    assert out.num_tokens["long"] == 5  # the rest of the budget
    assert out.admitted == [long]
    assert out.total_tokens == 8
    assert long.status == Status.RUNNING and e.running[-1] is long


def test_waiting_admitted_in_order_until_budget_spent():
    e = Engine(cfg_(max_num_batched_tokens=10), num_blocks=64)
    a, b, c, d = (e.add(x, 4) for x in "abcd")
    out = e.step()
    assert out.admitted == [a, b, c]
    assert [out.num_tokens[x] for x in "abc"] == [4, 4, 2]
    assert list(e.waiting) == [d]
    assert out.total_tokens == 10


def test_long_prompt_chunked_over_steps_while_decodes_get_one_token_each_step():
    e = Engine(cfg_(max_num_batched_tokens=16), num_blocks=64)
    decs = [e.add_running(f"d{i}", 3, computed=3, outputs=1, max_tokens=50) for i in range(2)]
    long = e.add("long", 50, max_tokens=3)
    chunks = []
    while not long.output_ids:
        out = e.step()
        for d in decs:
            assert out.num_tokens[d.request_id] == 1
        assert out.scheduled[:2] == decs  # decodes first, every step
        chunks.append(out.num_tokens["long"])
        assert out.total_tokens == (16 if long.num_computed_tokens < 50 else 10)
        assert len(chunks) < 10
    assert chunks == [14, 14, 14, 8]
    assert long.num_computed_tokens == 50 and len(long.output_ids) == 1
    # Then it decodes one token a step too, until it finishes.
    out = e.step()
    assert out.num_tokens == {"d0": 1, "d1": 1, "long": 1}
    e.step()
    assert long.finished and len(long.output_ids) == 3 and long.block_ids == []


def test_budget_never_exceeded_with_many_prefills_and_decodes():
    e = Engine(cfg_(max_num_batched_tokens=12, max_num_seqs=6), num_blocks=200)
    for i in range(10):
        e.add(f"r{i}", 3 + 7 * i % 23, max_tokens=1 + i % 5)
    for _ in range(200):
        if not (e.waiting or e.running):
            break
        out = e.step()
        assert out.total_tokens <= 12
    assert len(e.finished) == 10


# ---------------------------------------------------------------- chunked prefill off, threshold, max_num_seqs


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_then_runs_whole():
    e = Engine(cfg_(max_num_batched_tokens=10, enable_chunked_prefill=False), num_blocks=64)
    decs = [e.add_running(f"d{i}", 3, computed=3, outputs=1, max_tokens=4) for i in range(3)]
    big = e.add("big", 8, max_tokens=2)
    small = e.add("small", 1, max_tokens=2)
    for _ in range(3):  # d* need 3 more tokens each (1 -> 4 outputs); meanwhile 7 left < 8
        out = e.step()
        assert out.num_tokens == {"d0": 1, "d1": 1, "d2": 1}  # small does not overtake the blocked head
        assert big.status == Status.WAITING and big.block_ids == [] and big.num_computed_tokens == 0
    assert all(d.finished for d in decs)
    out = e.step()
    assert out.admitted == [big, small]
    assert out.num_tokens == {"big": 8, "small": 1}  # whole
    assert len(big.output_ids) == 1 and len(big.block_ids) == blocks_for(8, 4)


def test_without_chunked_prefill_fitting_prompt_is_scheduled_whole():
    e = Engine(cfg_(max_num_batched_tokens=10, enable_chunked_prefill=False), num_blocks=64)
    a = e.add("a", 6)
    b = e.add("b", 6)
    out = e.step()
    assert out.admitted == [a] and out.num_tokens == {"a": 6}
    assert list(e.waiting) == [b]
    out = e.step()  # a decodes 1, b (6) fits the remaining 9
    assert out.num_tokens == {"a": 1, "b": 6}


def test_with_chunked_prefill_same_prompt_is_chunked_instead():
    e = Engine(cfg_(max_num_batched_tokens=10), num_blocks=64)
    for i in range(3):
        e.add_running(f"d{i}", 3, computed=3, outputs=1)
    e.add("big", 8)
    out = e.step()
    assert out.num_tokens["big"] == 7


def test_long_prefill_token_threshold_caps_chunks():
    e = Engine(cfg_(max_num_batched_tokens=32, long_prefill_token_threshold=6), num_blocks=64)
    dec = e.add_running("dec", 4, computed=4, outputs=1)
    long = e.add("long", 20, max_tokens=2)
    short = e.add("short", 3, max_tokens=2)
    out = e.step()
    assert out.num_tokens == {"dec": 1, "long": 6, "short": 3}
    chunks = [6]
    while long.num_computed_tokens < 20:
        out = e.step()
        chunks.append(out.num_tokens["long"])
        assert out.num_tokens["dec"] == 1
    assert chunks == [6, 6, 6, 2]  # running partial prefills are capped too
    assert dec.status == Status.RUNNING and short.finished


def test_threshold_and_budget_both_cap():
    e = Engine(cfg_(max_num_batched_tokens=5, long_prefill_token_threshold=8), num_blocks=64)
    e.add("a", 20)
    out = e.step()
    assert out.num_tokens == {"a": 5}


def test_max_num_seqs_caps_running():
    e = Engine(cfg_(max_num_batched_tokens=100, max_num_seqs=2), num_blocks=64)
    reqs = [e.add(f"r{i}", 3, max_tokens=2 + i) for i in range(4)]
    out = e.step()
    assert out.admitted == reqs[:2] and len(e.running) == 2
    out = e.step()  # r0 finishes now (2 outputs), r1 decodes; nothing admitted (2 running at schedule time)
    assert out.admitted == [] and reqs[0].finished
    out = e.step()
    assert out.admitted == [reqs[2]]
    assert len(e.running) <= 2
    while e.running or e.waiting:
        e.step()
        assert len(e.running) <= 2
    assert all(len(r.output_ids) == r.max_tokens for r in reqs)


# ---------------------------------------------------------------- block allocation


def test_blocks_for():
    assert [blocks_for(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_prefill_allocates_ceil_blocks_and_decode_grows_one_at_a_time():
    bs = 4
    e = Engine(cfg_(block_size=bs, max_num_batched_tokens=64), num_blocks=64)
    req = e.add("a", 10, max_tokens=12)
    out = e.step()
    assert len(out.new_blocks["a"]) == 3 and len(req.block_ids) == 3
    grown = []
    while not req.finished:
        before = req.num_computed_tokens
        out = e.step()
        new = out.new_blocks["a"]
        assert len(new) == (1 if before % bs == 0 else 0), (before, new)
        if new:
            grown.append(before + 1)
        if not req.finished:
            assert len(req.block_ids) == blocks_for(req.num_computed_tokens, bs)
    assert grown == [13, 17, 21]  # tokens 13, 17 and 21 open blocks 4, 5 and 6
    assert e.pool.num_free == 64


def test_chunked_prefill_allocates_blocks_per_chunk():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=6), num_blocks=64)
    req = e.add("a", 10)
    out = e.step()
    assert out.num_tokens == {"a": 6} and len(out.new_blocks["a"]) == 2
    out = e.step()
    assert out.num_tokens == {"a": 4} and len(out.new_blocks["a"]) == 1
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3


def test_admission_waits_for_blocks_without_preempting():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=4)
    a = e.add_running("a", 8, computed=8, outputs=1)  # 2 blocks, decode needs a 3rd
    b = e.add("b", 8)  # needs 2, only 1 left after a's decode
    out = e.step()
    assert out.num_tokens == {"a": 1} and out.preempted == [] and out.admitted == []
    assert b.status == Status.WAITING and a.num_preemptions == 0


# ---------------------------------------------------------------- preemption


def test_fcfs_preempts_latest_running_and_admits_nothing():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=4)
    a = e.add_running("a", 8, computed=8, outputs=1)  # needs a 3rd block
    b = e.add_running("b", 8, computed=8, outputs=1)
    c = e.add("c", 1)  # would fit (1 block, budget plenty) but a step that preempted admits nothing
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [b]
    assert out.num_tokens == {"a": 1} and out.admitted == []
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and b.block_ids == []
    assert list(e.waiting) == [b, c]  # victim at the front
    assert e.running == [a] and len(a.block_ids) == 3
    assert e.pool.num_free == 1
    assert c.status == Status.WAITING
    # Next step: b (front) would recompute prompt + output (9 tokens, 3 blocks) but only 1 is free: it waits.
    out = e.step()
    assert out.preempted == [] and out.admitted == []
    assert list(e.waiting) == [b, c]


def test_preemption_takes_victims_from_the_back_until_enough_blocks():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=5)
    a = e.add_running("a", 20, computed=4)  # partial prefill: 16 left -> needs 4 more blocks
    b = e.add_running("b", 4, computed=4, outputs=1)
    c = e.add_running("c", 4, computed=4, outputs=1)
    d = e.add_running("d", 4, computed=4, outputs=1)
    e.add("w", 2)
    assert e.pool.num_free == 1
    out = e.step()
    assert out.preempted == [d, c, b]
    assert e.ids(e.waiting) == ["b", "c", "d", "w"]  # front, in their original order
    assert out.num_tokens == {"a": 16} and e.running == [a]
    assert all(r.num_preemptions == 1 for r in (b, c, d)) and a.num_preemptions == 0


def test_preemption_stops_as_soon_as_blocks_suffice():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=5)
    a = e.add_running("a", 8, computed=8, outputs=1)  # 2 blocks, needs a 3rd
    b, c, d = (e.add_running(x, 3, computed=3, outputs=1) for x in "bcd")  # decode inside their 1 block
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [d]
    assert out.num_tokens == {"a": 1, "b": 1, "c": 1}
    assert e.running == [a, b, c] and [r.num_preemptions for r in (a, b, c, d)] == [0, 0, 0, 1]


def test_request_that_preempts_itself_is_not_scheduled():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=4)
    a = e.add_running("a", 4, computed=4, outputs=1)  # 1 block; token 5 needs a 2nd
    b = e.add_running("b", 8, computed=8, outputs=1)  # 2 blocks; last running; token 9 needs a 3rd
    e.add("w", 1)
    # a takes the only free block; b then needs one with none free and is itself the latest.
    out = e.step()
    assert out.num_tokens == {"a": 1}
    assert out.preempted == [b] and b not in out.scheduled and "b" not in out.new_blocks
    assert b.num_preemptions == 1 and b.block_ids == [] and e.ids(e.waiting) == ["b", "w"]
    assert e.running == [a] and out.admitted == []
    assert e.pool.num_free == 2


def test_self_preemption_then_next_running_request_still_scheduled():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64, scheduling_policy="priority"), num_blocks=3)
    low = e.add_running("low", 8, computed=8, outputs=1, priority=9)  # first in order, needs a block
    high = e.add_running("high", 3, computed=3, outputs=1, priority=0)  # decode within its block
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [low] and "low" not in out.num_tokens
    assert out.num_tokens == {"high": 1}  # the index did not skip the request after the victim
    assert e.running == [high] and list(e.waiting) == [low]


def test_priority_victim_is_lowest_priority_then_latest():
    c = cfg_(block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    e = Engine(c, num_blocks=6)
    a = e.add_running("a", 8, computed=8, outputs=1, priority=0)  # needs a 3rd block
    b = e.add_running("b", 3, computed=3, outputs=1, priority=5)
    vict = e.add_running("c", 3, computed=3, outputs=1, priority=5)  # same priority as b, later
    d = e.add_running("d", 3, computed=3, outputs=1, priority=1)
    f = e.add_running("f", 3, computed=3, outputs=1, priority=2)  # latest overall, but better than b/c
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [vict]
    assert e.running == [a, b, d, f]
    assert out.num_tokens == {"a": 1, "b": 1, "d": 1, "f": 1}


def test_fcfs_victim_ignores_priority():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=3)
    a = e.add_running("a", 8, computed=8, outputs=1, priority=9)
    b = e.add_running("b", 3, computed=3, outputs=1, priority=-5)
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [b] and out.num_tokens == {"a": 1}
    assert a.num_preemptions == 0


def test_priority_victim_scheduled_earlier_in_step_is_unscheduled_and_budget_returned():
    c = cfg_(block_size=4, max_num_batched_tokens=10, scheduling_policy="priority")
    e = Engine(c, num_blocks=7)
    x = e.add_running("x", 13, computed=13, outputs=1, priority=9)  # 4 blocks; token 14 fits block 4
    y = e.add_running("y", 8, computed=8, outputs=1, priority=0)  # 2 blocks; token 9 needs a 3rd
    z = e.add_running("z", 20, computed=4, priority=0)  # 1 block; partial prefill
    assert e.pool.num_free == 0
    out = e.step()
    assert out.preempted == [x]
    assert x not in out.scheduled and "x" not in out.num_tokens and "x" not in out.new_blocks
    assert x.num_preemptions == 1 and x.block_ids == [] and list(e.waiting) == [x]
    # x's token went back to the budget: z gets 10 - 1 (y) = 9, not 8.
    assert out.num_tokens == {"y": 1, "z": 9}
    assert out.total_tokens == 10
    assert out.scheduled == [y, z] and out.admitted == []
    assert len(z.block_ids) == blocks_for(13, 4)


def test_step_schedule_unschedule():
    s = SchedulerOutput()
    r = make_req("a", 3)
    other = make_req("b", 3)
    s.scheduled.append(r)
    s.num_tokens["a"] = 3
    s.new_blocks["a"] = [1]
    assert s.unschedule(other) == 0
    assert s.unschedule(r) == 3
    assert s.scheduled == [] and s.num_tokens == {} and s.new_blocks == {} and s.total_tokens == 0


def test_preempted_request_recomputes_prompt_and_outputs_then_continues():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=64), num_blocks=4)
    a = e.add_running("a", 8, computed=8, outputs=1, max_tokens=3)
    b = e.add_running("b", 6, computed=6, outputs=1, max_tokens=3)  # 2 blocks
    e.step()  # a needs a 3rd block -> b preempted
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and len(b.output_ids) == 1
    while b.status != Status.RUNNING:
        e.step()
    assert b.num_computed_tokens == 7  # prompt 6 + 1 output recomputed in one go
    assert len(b.output_ids) == 2  # and then sampled its next token
    while e.running or e.waiting:
        e.step()
    assert len(a.output_ids) == 3 and len(b.output_ids) == 3
    assert e.pool.num_free == 4


# ---------------------------------------------------------------- priority ordering of waiting


def test_priority_orders_waiting_by_priority_then_arrival():
    c = cfg_(max_num_batched_tokens=100, max_num_seqs=3, scheduling_policy="priority")
    e = Engine(c, num_blocks=64)
    a = e.add("a", 3, priority=3)
    b = e.add("b", 3, priority=1)
    cc = e.add("c", 3, priority=1)
    d = e.add("d", 3, priority=0)
    out = e.step()
    assert out.admitted == [d, b, cc]
    assert list(e.waiting) == [a]


def test_fcfs_ignores_priority_for_admission():
    e = Engine(cfg_(max_num_batched_tokens=100, max_num_seqs=3), num_blocks=64)
    a = e.add("a", 3, priority=3)
    b = e.add("b", 3, priority=1)
    cc = e.add("c", 3, priority=1)
    e.add("d", 3, priority=0)
    out = e.step()
    assert out.admitted == [a, b, cc]


def test_priority_preempted_victim_not_ahead_of_better_waiting():
    c = cfg_(block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    e = Engine(c, num_blocks=4)
    e.add_running("a", 8, computed=8, outputs=1, priority=0)
    b = e.add_running("b", 8, computed=8, outputs=1, priority=5)
    w = e.add("w", 1, priority=1)
    out = e.step()
    assert out.preempted == [b]
    assert list(e.waiting) == [w, b]  # re-sorted by (priority, arrival)


# ---------------------------------------------------------------- block pool


def test_block_pool_allocate_release_and_check():
    p = BlockPool(6)
    a = p.allocate(2)
    b = p.allocate(3)
    assert p.num_free == 1 and p.num_used == 5 and p.usage == pytest.approx(5 / 6)
    assert len(set(a + b)) == 5
    p.check([a, b])
    with pytest.raises(NoFreeBlocks):
        p.allocate(2)
    p.check([a, b])  # a failed allocation changes nothing
    p.release(a)
    p.check([b])
    with pytest.raises(AssertionError):
        p.check([a, b])
    p.release(b)
    p.check([])
    assert p.num_free == 6
    assert {x: st.ref_count for x, st in p.take_changes().items()} == {x: 0 for x in a + b}
    assert p.take_changes() == {}
    c = p.allocate(2)
    assert {x: st.ref_count for x, st in p.take_changes().items()} == {x: 1 for x in c}


def test_block_pool_shared_block_freed_only_at_last_reference():
    p = BlockPool(4, refs={0: 2})
    assert p.num_free == 3 and 0 not in p.free
    p.check([[0], [0]])
    t1 = [0] + p.allocate(1)
    p.release(t1)
    assert p.num_free == 3 and p.ref_counts[0] == 1
    p.check([[0]])
    p.release([0])
    assert p.num_free == 4
    p.check([])


# ---------------------------------------------------------------- randomized simulation


CONFIGS = [
    dict(),
    dict(scheduling_policy="priority"),
    dict(enable_chunked_prefill=False),
    dict(enable_chunked_prefill=False, scheduling_policy="priority"),
    dict(long_prefill_token_threshold=5),
    dict(long_prefill_token_threshold=7, scheduling_policy="priority", max_num_seqs=3),
]


@pytest.mark.parametrize("extra", CONFIGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation_invariants(extra, seed):
    rng = random.Random(seed)
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=6, enable_prefix_caching=False)
    kw.update(extra)
    cfg = PolicyConfig(**kw)
    num_blocks = 10
    e = Engine(cfg, num_blocks=num_blocks)
    pending = []
    for i in range(40):
        # prompt + outputs to recompute after a preemption must fit the pool and (unchunked) the budget.
        p, m = rng.randint(1, 20), rng.randint(1, 12)
        assert blocks_for(p + m - 1, cfg.block_size) <= num_blocks and p + m - 1 <= cfg.max_num_batched_tokens
        pending.append((f"r{i}", p, m, rng.randint(0, 3)))
    all_reqs = []
    steps = 0
    total_preemptions = 0
    while pending or e.waiting or e.running:
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if pending:
                all_reqs.append(e.add(*pending.pop(0)))
        out = e.step()  # checks pool.check and the step contract each time
        total_preemptions += len(out.preempted)
        steps += 1
        assert steps < 3000, "no progress"
    assert len(e.finished) == 40
    for r in all_reqs:
        assert r.finished and len(r.output_ids) == r.max_tokens and r.block_ids == []
    assert sum(r.num_preemptions for r in all_reqs) == total_preemptions
    assert total_preemptions > 0, "the simulation is meant to exercise preemption"
    assert e.pool.num_free == num_blocks
    e.pool.check([])


def test_priority_tie_broken_by_arrival_not_queue_position():
    c = cfg_(block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    e = Engine(c, num_blocks=4)
    w = e.add("w", 9, priority=1)  # arrived first; needs 3 blocks, so it stays waiting
    a = e.add_running("a", 8, computed=8, outputs=1, max_tokens=3, priority=0)
    b = e.add_running("b", 8, computed=8, outputs=1, priority=1)  # same priority as w, later
    out = e.step()
    assert out.preempted == [b]
    assert list(e.waiting) == [w, b]  # b went to the front, but w arrived earlier
    for _ in range(10):
        if w.status != Status.WAITING:
            break
        e.step()
    assert a.finished and w.status == Status.RUNNING
    assert b.status == Status.WAITING  # w admitted first (b needs 3 blocks too; only 1 left)


def test_last_budget_token_still_goes_to_a_decode():
    e = Engine(cfg_(max_num_batched_tokens=3), num_blocks=64)
    decs = [e.add_running(f"d{i}", 3, computed=3, outputs=1) for i in range(4)]
    e.add("w", 5)
    out = e.step()
    assert out.scheduled == decs[:3] and out.total_tokens == 3 and out.admitted == []
    e2 = Engine(cfg_(max_num_batched_tokens=3), num_blocks=64)
    e2.add_running("d", 3, computed=3, outputs=1)
    e2.add("w", 5)
    assert e2.step().num_tokens == {"d": 1, "w": 2}


def test_self_preemption_stops_the_victim_search_even_if_blocks_still_short():
    e = Engine(cfg_(block_size=4, max_num_batched_tokens=17), num_blocks=3)
    a = e.add_running("a", 3, computed=3, outputs=1)  # decode inside its block
    b = e.add_running("b", 20, computed=4)  # 1 block; a 16-token chunk needs 4 more, only 1 free
    out = e.step()
    assert out.preempted == [b]  # b gives up its own block (2 free then, still < 4) and stops there
    assert out.num_tokens == {"a": 1} and e.running == [a] and a.num_preemptions == 0
    assert list(e.waiting) == [b] and e.pool.num_free == 2


def test_queue_timeout_spares_requests_a_previous_leader_already_scheduled():
    """After a fail-over the new leader recomputes resumed requests from the queue: the queue timeout (a bound on
    the wait for a first step) must not expire them, only requests that never ran."""
    core = SchedulerCore(cfg_(max_num_batched_tokens=8), BlockPool(64), queue_timeout=1.0)
    ran = make_req("ran", 8, seq=0)
    ran.status, ran.output_ids = Status.RUNNING, [5, 6]
    preempted = make_req("preempted", 8, seq=1)
    preempted.num_preemptions = 1
    never = make_req("never", 8, seq=2)
    for req in (ran, preempted, never):
        req.arrival_time = 100.0
    core.resume([ran, preempted, never])
    core.schedule(now=200.0)
    assert never.finish_reason == "timeout"
    assert ran.finish_reason is None and preempted.finish_reason is None
