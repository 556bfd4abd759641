"""Hybrid models' state slots in the Redis ledger, against a real redis-server: ownership written by every step's
commit under the invariant check, read back by a new leader (snapshots kept, requests' slots freed), and a commit
that breaks the invariant refused before any write."""

from __future__ import annotations

import pytest
import redis

from scheduler_svc.core.state_pool import from_records
from scheduler_svc.core.step_records import StepCommit
from scheduler_svc.ledger.store import InvariantViolation, RedisLedger
from tests.support.hybrid_plans import Stack, expected_output, toks

HOLDER = "sched-h"
TTL_MS = 5000


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis.Redis.from_url(redis_server)
    c.flushdb()
    yield c
    c.close()


def leading(client, num_blocks: int, num_slots: int) -> tuple[RedisLedger, int]:
    led = RedisLedger(client, namespace="h")
    assert led.init_pool(num_blocks, 16, num_slots)
    return led, led.try_acquire_lease(HOLDER, TTL_MS)


def test_every_step_commits_slot_ownership_and_a_new_leader_keeps_the_snapshots(client, redis_server):  # noqa: F811
    led, token = leading(client, num_blocks=9, num_slots=4)
    seen: list[dict] = []

    def commit(c: StepCommit) -> None:
        led.commit_step(HOLDER, token, TTL_MS, c)  # with the invariant check: a broken count is refused
        seen.append(led.check_ledger())

    s = Stack(num_blocks=9, num_slots=4, share=0.5, commit=commit)
    reqs = [r for i, n in enumerate([40, 23, 70, 33]) for r in s.add(f"r{i}", toks(n, base=i + 1), max_tokens=20,
                                                                      n=2 if i == 1 else 1)]
    s.run()
    assert s.preemptions > 0
    assert all(r.output_ids == expected_output(r.prompt_ids, 20) for r in reqs)
    assert all(x["state_free"] + x["state_owned"] == 4 and x["state_overlap"] == 0 for x in seen)
    assert max(x["state_owned"] for x in seen) >= 3  # requests and snapshots held slots along the way
    # A new leader on a fresh connection reads the same owners the mirror holds.
    with redis.Redis.from_url(redis_server) as c2:
        state = RedisLedger(c2, namespace="h").load()
    states = s.core.states
    assert state.state_records == {slot: states.record(slot) for slot in range(4) if states.record(slot)}
    again = from_records(4, 2, state.state_records)
    assert dict(again.index) == dict(states.index) and again.num_snapshots == len(states.snapshot) > 0


def test_a_new_leader_frees_the_slots_requests_held_and_the_next_commit_writes_them(client):
    led, token = leading(client, num_blocks=32, num_slots=4)
    s = Stack(num_blocks=32, num_slots=4, commit=lambda c: led.commit_step(HOLDER, token, TTL_MS, c))
    s.add("a", toks(40), max_tokens=50)
    s.add("b", toks(30, base=2), max_tokens=50)
    for _ in range(4):  # mid-stream: both hold slots, the prompt snapshots are saved
        s.step()
    records = led.load().state_records
    assert sorted(r[:2] for r in records.values()) == ["r:", "r:", "s:", "s:"]
    pool = from_records(4, 2, records)
    assert not pool.owner and pool.num_snapshots == 2
    led.commit_step(HOLDER, token, TTL_MS, StepCommit(step_id=99, arrival_seq=2, state_changes=pool.take_changes(),
                                                      check_invariant=True))
    assert led.check_ledger()["state_owned"] == 2 == led.check_ledger()["state_free"]


def test_a_commit_that_breaks_the_slot_invariant_is_refused_before_any_write(client):
    led, token = leading(client, num_blocks=8, num_slots=2)
    ok = StepCommit(step_id=1, arrival_seq=0, state_changes={0: "r:a"}, check_invariant=True)
    led.commit_step(HOLDER, token, TTL_MS, ok)
    with pytest.raises(InvariantViolation, match="state slot 5 outside 0..1"):
        led.commit_step(HOLDER, token, TTL_MS, StepCommit(step_id=2, arrival_seq=0, state_changes={5: "r:b"},
                                                          check_invariant=True))
    assert led.check_ledger()["state_owned"] == 1 and led.load().step_id == 1
