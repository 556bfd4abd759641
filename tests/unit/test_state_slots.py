"""Hybrid models' state slots on the scheduler side, pure: the slot pool (ownership, snapshots, budget, LRU,
records), and the core driven through the real plan encoding against a recorder of exact recurrent state
(tests/support/hybrid_plans.py): preemption, n = 2, mixed lengths, prefix hits on a repeated prompt and on an
extended conversation, the snapshot budget; the worker's auto slot count (--num-state-slots 0) as a pure function.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.config import ConfigError
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.state_pool import NoFreeStateSlots, StateSlotPool, from_records
from tests.support.hybrid_plans import Stack, expected_output, toks
from worker_svc.core.state_cache import auto_num_slots

# ---- the worker's auto slot count ----------------------------------------------------------------------------

MiB = 1 << 20


@pytest.mark.parametrize("max_num_seqs, share, expected", [
    (64, 0.5, 128),  # the CPU default: as many snapshots as running sequences
    (256, 0.5, 512),  # the CUDA default
    (10, 0.0, 10),  # no prefix caching of the state: one slot per sequence, none spare
    (10, 0.3, 15),  # 10 / 0.7 = 14.3: 15 slots, of which snapshots may hold int(4.5) = 4
    (10, 0.75, 40),
    (1, 0.5, 2),
])
def test_auto_slots_are_one_per_running_sequence_plus_the_snapshot_share(max_num_seqs, share, expected):
    n = auto_num_slots(MiB, 1 << 40, max_num_seqs, share)
    assert n == expected
    # with snapshots at their bound every running sequence still finds a slot (the scheduler's budget, policy.py)
    snapshots = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, block_size=16, num_state_slots=n,
                             state_snapshot_share=share).max_state_snapshots
    assert n - snapshots >= max_num_seqs


def test_auto_slots_are_bounded_by_half_the_memory_budget():
    # a 1 GiB budget (long contexts want most of it for KV): the state pool never takes more than 512 MiB of it
    assert auto_num_slots(4 * MiB, 1024 * MiB, 64, 0.5) == 128  # 512 MiB: exactly the 128 wanted
    assert auto_num_slots(8 * MiB, 1024 * MiB, 64, 0.5) == 64  # only 64 fit in half: running slots, no spare
    assert auto_num_slots(8 * MiB, 1024 * MiB, 256, 0.5) == 64  # fewer than --max-num-seqs: the scheduler caps it
    assert auto_num_slots(MiB, 100 * MiB, 4, 1.0) == 50  # share 1: snapshots may take all the bound allows
    with pytest.raises(ConfigError, match=r"no state slot of 8388608 bytes fits in half the KV memory budget "
                                          r"\(8388608 bytes\).*--num-state-slots"):
        auto_num_slots(8 * MiB, 8 * MiB, 64, 0.5)


# ---- the pool -------------------------------------------------------------------------------------------------


def test_requests_take_free_slots_then_evict_the_least_recently_used_snapshot():
    pool = StateSlotPool(3, 2)
    a = pool.reserve_snapshot("a")
    assert pool.confirm(a, b"k1", 16)
    b = pool.reserve_snapshot("b")
    assert pool.confirm(b, b"k2", 32)
    pool.use(a)  # k1 is now the most recently used
    pool.end_step()
    r1 = pool.allocate("r1")  # the one free slot
    assert r1 not in (a, b) and pool.num_available == 2
    r2 = pool.allocate("r2")  # evicts k2, the least recently used
    assert r2 == b and pool.lookup(b"k2") is None and pool.lookup(b"k1") == a
    pool.use(a)  # read by a copy in the step being scheduled: not evictable in it
    with pytest.raises(NoFreeStateSlots):
        pool.allocate("r3")
    pool.end_step()
    assert pool.allocate("r3") == a
    pool.check({"r1": r1, "r2": r2, "r3": a})


def test_snapshots_stay_within_their_budget_and_never_take_a_requests_slot():
    pool = StateSlotPool(4, 2)
    held = [pool.allocate(f"r{i}") for i in range(2)]
    s1, s2 = pool.reserve_snapshot("r0"), pool.reserve_snapshot("r1")
    assert s1 is not None and s2 is not None
    assert pool.reserve_snapshot("r0") is None  # the budget is pending snapshots that cannot be evicted
    pool.confirm(s1, b"x", 16)
    s3 = pool.reserve_snapshot("r1")  # evicts the ready one, never a request's slot
    assert s3 == s1 and pool.lookup(b"x") is None
    assert pool.num_snapshots == 2 and set(held) == set(pool.owner)
    assert not pool.confirm(s2, b"y", 16) or pool.lookup(b"y") == s2
    pool.cancel(s3)
    pool.check({"r0": held[0], "r1": held[1]})


def test_a_duplicate_snapshot_is_freed_and_the_records_rebuild_the_snapshots_only():
    pool = StateSlotPool(4, 3)
    r = pool.allocate("r")
    s1 = pool.reserve_snapshot("r")
    pool.confirm(s1, b"\x01" * 16, 32)
    s2 = pool.reserve_snapshot("r")
    assert not pool.confirm(s2, b"\x01" * 16, 32)  # the same prefix: one snapshot of it
    pending = pool.reserve_snapshot("r")
    records = {s: pool.record(s) for s in range(4) if pool.record(s)}
    assert records == {r: "r:r", s1: f"s:{'01' * 16}:32:1", pending: "p:r"}
    again = from_records(4, 3, records)
    assert again.lookup(b"\x01" * 16) == s1 and not again.owner and not again.pending
    assert again.take_changes() == {r: "", pending: ""}  # written free by the next commit
    again.check({})


# ---- the core through the plans ---------------------------------------------------------------------------------


def test_few_state_slots_preempt_and_every_output_is_exact():
    """Three slots, a KV pool that runs dry, mixed lengths and an n = 2 request: preemptions happen, state slots
    bound the batch, and every sequence's state and output are exact."""
    s = Stack(num_blocks=9, num_slots=3, share=0.34, max_num_seqs=8)
    prompts = {f"r{i}": toks(n, base=i + 1) for i, n in enumerate([40, 7, 70, 23, 55, 16])}
    reqs = {}
    for rid, p in prompts.items():
        for r in s.add(rid, p, max_tokens=20, n=2 if rid == "r3" else 1):
            reqs[r.request_id] = (r, p)
    s.run()
    assert s.preemptions > 0 and s.max_running == 3 and "state_slots" in s.stopped_by
    for rid, (r, p) in reqs.items():
        assert r.output_ids == expected_output(p, 20), rid
    assert len(reqs) == 7


def test_a_repeated_40_token_prompt_hits_its_snapshot_with_identical_tokens():
    s = Stack()
    p = toks(40, base=3)
    (cold,) = s.add("cold", p, max_tokens=5)
    s.run()
    assert s.hits == 0 and s.worker.saves >= 1
    (warm,) = s.add("warm", p, max_tokens=5)
    s.run()
    assert s.hits == 32 and s.worker.copies == 1  # the last full block boundary a repeat can use
    assert warm.output_ids == cold.output_ids == expected_output(p, 5)


def test_an_extended_conversation_hits_at_the_previous_turns_last_boundary():
    s = Stack()
    p1 = toks(21, base=5)
    (turn1,) = s.add("t1", p1, max_tokens=30)
    s.run()
    history = p1 + turn1.output_ids  # 51 tokens: its KV and state were computed up to 50
    p2 = history + toks(9, base=9)
    (turn2,) = s.add("t2", p2, max_tokens=6)
    s.run()
    assert s.hits == 48  # the last block boundary the first turn reached
    assert turn2.output_ids == expected_output(p2, 6)
    # Only the first turn's latest boundary past its prompt is kept, beside its prompt's snapshot.
    assert s.core.states.num_snapshots <= 3


def test_snapshots_never_exceed_their_share_of_the_slots():
    s = Stack(num_slots=8, share=0.25)
    for i in range(12):
        s.add(f"q{i}", toks(20 + 9 * i, base=40 + i), max_tokens=20)
    s.run()
    assert 0 < s.max_snapshots_seen <= 2


def test_without_prefix_caching_no_snapshot_is_taken_and_n2_recomputes():
    s = Stack(enable_prefix_caching=False)
    reqs = s.add("r", toks(40), max_tokens=5, n=2)
    s.run()
    assert s.worker.saves == s.worker.copies == 0
    assert all(r.output_ids == expected_output(toks(40), 5) for r in reqs)


def test_worker_loss_cancels_pending_snapshots_and_frees_every_slot():
    s = Stack()
    s.add("a", toks(40), max_tokens=5)
    out = s.core.schedule(0.0)
    assert out.state_saves  # the first chunk ends at the prompt's boundary (32)
    assert out.num_tokens["a"] == 32
    s.core.worker_lost()
    assert s.core.states.num_snapshots == 0 and not s.core.states.owner
    s.core.check_invariant()


def test_speculation_with_a_hybrid_model_is_accepted_and_slots_cap_max_num_seqs():
    from common.speculative_config import parse_speculative_config
    from protos import worker_pb2 as wpb
    from scheduler_svc.ledger.leadership import sized_policy

    info = wpb.WorkerInfo(block_size=16, num_blocks=64, max_model_len=256, device="cpu", num_state_slots=6,
                          model=wpb.ModelInfo(name="tiny-qwen3_5"))
    base = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=32, block_size=0)
    sized = sized_policy(base, info)
    assert sized.max_num_seqs == 6 and sized.num_state_slots == 6 and sized.snapshots
    spec = replace(base, speculative=parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}'))
    # Rejected drafts of every method are rolled back out of the recurrent state by the worker (draft_rollback.py).
    assert sized_policy(spec, info).speculative == spec.speculative
    mtp = replace(base, speculative=parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2}'))
    assert sized_policy(mtp, info).speculative.method == "mtp"


@pytest.mark.parametrize("num_blocks, num_slots", [(9, 4), (64, 8)])
def test_pipelined_steps_keep_every_state_exact(num_blocks, num_slots):
    """Planned one step ahead (--async-scheduling): a request the worker finishes while the next plan names it,
    snapshots saved by a step whose request ended meanwhile, preemption and forks, all with exact states. Slots
    held by requests leave snapshots only the rest: with 4 slots and 4 running there are none."""
    s = Stack(num_blocks=num_blocks, num_slots=num_slots, share=0.5)
    reqs = [r for i, n in enumerate([40, 7, 70, 23, 33, 40]) for r in s.add(f"p{i}", toks(n, base=i % 5 + 1),
                                                                          max_tokens=17, n=2 if i == 3 else 1)]
    s.run_pipelined()
    assert all(r.output_ids == expected_output(r.prompt_ids, 17) for r in reqs)
    assert (s.preemptions > 0) == (num_blocks == 9)
    if num_slots == 8:
        assert s.hits > 0 and s.worker.copies > 0  # the n = 2 sibling starts from its first's prompt snapshot
