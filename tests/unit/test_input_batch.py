"""The persistent input batch and the vectorized step inputs against the per-chunk construction they replaced
(tests/legacy_host_path.py): random mixed batches of prefill chunks and decodes over shuffled block tables, with
requests joining, resuming, being dropped and finishing; and the array check of cached requests against the
request-by-request one."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import kernels
import kernels.reference as ref
import kernels.reference_plan as reference_plan
from protos import worker_pb2 as pb
from tests.support import legacy_host_path as legacy
from tests.support.plans import Cached, Wire, add_cached
from worker_svc.core.errors import InvalidPlan, PlanError
from worker_svc.core.input_batch import InputBatch
from worker_svc.core.persistent_batch import BatchLimits, CachedDeltas, PersistentBatch, Schedule
from worker_svc.core.step_inputs import build_model_inputs
from worker_svc.wire import step_plan

BLOCK = 4
VOCAB = 50


@pytest.fixture(autouse=True)
def _gathered_decodes(monkeypatch):
    """The legacy construction gathers decodes into SDPA groups: compare against the same, not the C++ kernel's
    record (tests/unit/test_cpu_ops.py covers that path)."""
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")


def assert_same(a, b, path="") -> None:
    """Deep equality of metadata / plans: tensors by dtype, shape and value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            if f.name not in ("scratch", "masks"):  # caches filled on use
                assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def run_plan(batch: PersistentBatch, plan: pb.StepPlan) -> Schedule:
    """Check and apply a wire plan, as the worker does."""
    p = step_plan(plan)
    return batch.apply_plan(p, batch.check_plan(p, "e"))


def tokens_of(inputs: InputBatch, rid: str) -> list[int]:
    row = inputs.row_of[rid]
    return inputs.token_ids[row, : inputs.num_tokens[row]].tolist()


def blocks_of(inputs: InputBatch, rid: str) -> list[int]:
    row = inputs.row_of[rid]
    return inputs.block_table[row, : inputs.num_blocks[row]].tolist()


@dataclasses.dataclass
class Shadow:
    """The test's own record of a request, as the old list-based batch held it."""

    tokens: list[int]
    blocks: list[int]
    computed: int


class Driver:
    """Random valid plans for a PersistentBatch, with a shadow of what the old batch would hold."""

    def __init__(self, seed: int, num_blocks: int = 8000, max_model_len: int = 200):
        self.rng = random.Random(seed)
        self.batch = PersistentBatch(BatchLimits(num_blocks, BLOCK, max_model_len, VOCAB))
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.live: dict[str, Shadow] = {}
        self.wire = Wire()
        self.step = 0
        self.next_id = 0

    def blocks_for(self, s: Shadow, upto: int) -> list[int]:
        need = -(-upto // BLOCK) - len(s.blocks) + self.rng.choice([0, 0, 0, 1])  # sometimes one spare
        return [self.free.pop() for _ in range(max(0, need))]

    def plan(self) -> tuple[pb.StepPlan, list[tuple[str, int, int]]]:
        """A plan and the chunks (request id, start, length) the old batch would have scheduled, in plan order."""
        rng = self.rng
        self.step += 1
        chunks: list[tuple[str, int, int]] = []  # new requests, then resumed ones (plan order), then cached
        resumed: list[tuple[str, int, int]] = []
        new_entries, resumed_entries, cached_entries, dropped = [], [], [], []
        for rid in list(self.live):
            if rng.random() < 0.05:  # dropped (preempted): its blocks come back
                dropped.append(rid)
                self.free += self.live.pop(rid).blocks
        for _ in range(rng.choice([0, 0, 1, 3, 8])):
            rid = f"r{self.next_id}"
            self.next_id += 1
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
            s = Shadow(list(prompt), [], rng.choice([0, 0, len(prompt) // 2]))
            n = rng.randint(0, len(prompt) - s.computed)
            s.blocks = self.blocks_for(s, s.computed + n)
            sp = pb.SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(1 << 63))
            into = chunks
            if rng.random() < 0.3:  # resumed: prompt + some output, recomputed from scratch
                into = resumed
                out = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
                s.tokens += out
                s.computed, n = 0, rng.randint(0, len(s.tokens))
                self.free += s.blocks
                s.blocks = []
                s.blocks = self.blocks_for(s, n)
                resumed_entries.append(pb.ResumedRequest(
                    request_id=rid, token_ids=s.tokens, num_prompt_tokens=len(prompt), sampling=sp,
                    block_ids=s.blocks, num_scheduled_tokens=n))
            else:
                new_entries.append(pb.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp,
                                                 block_ids=s.blocks, num_computed_tokens=s.computed,
                                                 num_scheduled_tokens=n))
            self.live[rid] = s
            if n:
                into.append((rid, s.computed, n))
        chunks += resumed
        joined = {r.request_id for r in new_entries} | {r.request_id for r in resumed_entries}
        for rid, s in self.live.items():
            if rid in joined or rng.random() < 0.1:
                continue  # not scheduled this step
            n = rng.randint(0, min(len(s.tokens) - s.computed, rng.choice([1, 1, 1, 7, 30])))
            entry = Cached(rid, n)
            cached_entries.append(entry)
            if rng.random() < 0.05:  # the whole table again, with its blocks moved elsewhere
                self.free += s.blocks
                self.rng.shuffle(self.free)
                s.blocks = [self.free.pop() for _ in s.blocks]
                entry.block_table = list(s.blocks)
            new = self.blocks_for(s, s.computed + n)
            s.blocks += new
            entry.new_block_ids = new
            if n:
                chunks.append((rid, s.computed, n))
        plan = self.wire.plan(step_id=self.step, new_requests=new_entries, resumed_requests=resumed_entries,
                              cached_requests=cached_entries, dropped_request_ids=dropped)
        return plan, chunks

    def legacy_inputs(self, chunks: list[tuple[str, int, int]]):
        return legacy.prepare([(self.live[rid].tokens, start, n, self.live[rid].blocks) for rid, start, n in chunks],
                              BLOCK)

    def after_step(self, chunks: list[tuple[str, int, int]], sample_rows: np.ndarray) -> None:
        """What the runner does after the forward: advance, append one token per sampling row, finish some."""
        inputs = self.batch.inputs
        rows = np.array([inputs.row_of[rid] for rid, _, _ in chunks], dtype=np.int64)
        inputs.num_computed_tokens[rows] += np.array([n for _, _, n in chunks], dtype=np.int64)
        for rid, start, n in chunks:
            self.live[rid].computed = start + n
        tokens = np.array([self.rng.randrange(VOCAB) for _ in sample_rows], dtype=np.int64)
        inputs.append_tokens(sample_rows, tokens)
        for row, tok in zip(sample_rows.tolist(), tokens.tolist(), strict=True):
            rid = inputs.request_ids[row]
            s = self.live[rid]
            s.tokens.append(tok)
            if len(s.tokens) >= self.batch.limits.max_model_len - 1 or self.rng.random() < 0.05:
                inputs.free(row)  # finished
                self.wire.slots.finished(row, rid)
                self.free += self.live.pop(rid).blocks


@pytest.mark.parametrize("seed", range(6))
def test_step_inputs_equal_the_per_chunk_construction(seed):
    d = Driver(seed)
    for _ in range(40):
        plan, chunks = d.plan()
        sched = run_plan(d.batch, plan)
        assert [(d.batch.inputs.request_ids[r], s, n) for r, s, n in
                zip(sched.rows.tolist(), sched.starts.tolist(), sched.lengths.tolist(), strict=True)] == chunks
        inputs = d.batch.inputs
        for rid, s in d.live.items():  # the rows hold what the old batch held
            assert tokens_of(inputs, rid) == s.tokens and blocks_of(inputs, rid) == s.blocks
            assert inputs.num_computed_tokens[inputs.row_of[rid]] == s.computed
        if not chunks:
            continue
        ids, pos, meta, logits_idx, samplers = d.legacy_inputs(chunks)
        got = build_model_inputs(sched, BLOCK, torch.device("cpu"), build_plan=True)
        assert_same(got.input_ids, ids)
        assert_same(got.positions, pos)
        assert_same(got.logits_indices, logits_idx)
        assert_same(got.attn_metadata, meta)
        assert [d.batch.inputs.request_ids[r] for r in got.sample_rows.tolist()] == [chunks[i][0] for i in samplers]
        d.after_step(chunks, got.sample_rows)


def random_shapes(rng: random.Random, n: int, block_size: int):
    q, s, tables = [], [], []
    for _ in range(n):
        kind = rng.random()
        ql = 1 if kind < 0.6 else (0 if kind < 0.65 else rng.randint(2, 80))
        sl = ql + rng.choice([0, rng.randint(0, 50), rng.randint(0, 3000)])
        q.append(ql)
        s.append(sl)
        tables.append([rng.randrange(1000) for _ in range(-(-sl // block_size) + rng.choice([0, 0, 1, 3]))])
    return q, s, tables


@pytest.mark.parametrize("group_rows", [ref.DECODE_GROUP_ROWS, 300, float("inf")])  # inf: as on CUDA
def test_attention_metadata_equals_the_torch_construction(monkeypatch, group_rows):
    # The plan builder reads the constant from its own module; kernels.reference only re-exports the value.
    monkeypatch.setattr(reference_plan, "DECODE_GROUP_ROWS", group_rows)
    monkeypatch.setattr(legacy, "DECODE_GROUP_ROWS", group_rows)
    for seed in range(60):
        rng = random.Random(seed)
        block_size = rng.choice([1, 4, 16])
        q, s, tables = random_shapes(rng, rng.choice([0, 1, 2, 5, 30, 200]), block_size)
        for build_plan in (True, False):
            assert_same(kernels.build_attention_metadata(q, s, tables, block_size, "cpu", build_plan=build_plan),
                        legacy.build_attention_metadata(q, s, tables, block_size, "cpu", build_plan=build_plan))


def test_rows_grow_and_are_reused():
    batch = PersistentBatch(BatchLimits(num_blocks=12000, block_size=BLOCK, max_model_len=5000, vocab_size=VOCAB))
    plan = pb.StepPlan(step_id=1)
    for i in range(70):  # more rows than the initial 64; a prompt longer than the initial 512 columns
        n = 600 if i == 69 else 3
        plan.new_requests.add(slot=i, request_id=f"r{i}", prompt_token_ids=[i % VOCAB] * n,
                              sampling=pb.SamplingParams(stop_token_ids=list(range(i % 5))),
                              block_ids=list(range(i * 160, i * 160 + -(-n // BLOCK))), num_scheduled_tokens=n)
    sched = run_plan(batch, plan)
    inputs = batch.inputs
    assert len(sched) == 70 and inputs.num_rows == 128 and inputs.token_ids.shape[1] >= 600
    assert sched.rows.tolist() == list(range(70))  # a request's slot is its row
    assert blocks_of(inputs, "r69") == list(range(69 * 160, 69 * 160 + 150))  # beyond 32 columns
    inputs.free(3)  # frees row 3: the slot can be given again, with nothing left of r3
    assert "r3" not in inputs.row_of and len(inputs) == 69
    plan = pb.StepPlan(step_id=2)
    plan.new_requests.add(slot=3, request_id="x", prompt_token_ids=[7], block_ids=[11999], num_scheduled_tokens=1)
    run_plan(batch, plan)
    assert inputs.row_of["x"] == 3
    assert (tokens_of(inputs, "x"), blocks_of(inputs, "x"), list(inputs.params[3].stop_token_ids)) == (
        [7], [11999], [])
    assert (inputs.stop_token_ids[3] == -1).all() and inputs.block_table[3, 1:].sum() == 0
    inputs.append_tokens(np.array([3]), np.array([9]))
    assert tokens_of(inputs, "x") == [7, 9] and inputs.num_prompt_tokens[3] == 1
    run_plan(batch, pb.StepPlan(step_id=3, reset_batch=True))
    assert not len(inputs) and not inputs.live.any()


def test_a_dropped_slot_is_given_again_in_the_same_plan():
    batch = PersistentBatch(BatchLimits(num_blocks=64, block_size=BLOCK, max_model_len=100, vocab_size=VOCAB))
    plan = pb.StepPlan(step_id=1)
    plan.new_requests.add(slot=0, request_id="a", prompt_token_ids=[1, 2], block_ids=[5], num_scheduled_tokens=2)
    run_plan(batch, plan)
    taken = pb.StepPlan(step_id=2)
    taken.new_requests.add(slot=0, request_id="b", prompt_token_ids=[3], block_ids=[6], num_scheduled_tokens=1)
    with pytest.raises(InvalidPlan, match="slot 0 still holds request 'a'") as e:
        batch.check_plan(step_plan(taken), "e")
    assert (e.value.slot, e.value.request_id) == (0, "b")
    taken.dropped_slots.append(0)
    sched = run_plan(batch, taken)
    assert sched.rows.tolist() == [0] and list(batch.inputs.row_of) == ["b"] and blocks_of(batch.inputs, "b") == [6]


def test_array_check_of_cached_requests_agrees_with_the_request_by_request_one():
    """_cached_valid must pass exactly the plans _check_each_cached passes (it is the fast path of the same
    check), on random cached deltas with every kind of fault."""
    d = Driver(seed=11)
    for _ in range(15):
        plan, chunks = d.plan()
        sched = run_plan(d.batch, plan)
        d.after_step(chunks, build_model_inputs(sched, BLOCK, torch.device("cpu"), build_plan=False).sample_rows)
    b, rng = d.batch, random.Random(5)
    live_slots = np.flatnonzero(b.inputs.live).tolist()
    free_slot = int(np.flatnonzero(~b.inputs.live)[0])
    verdicts = set()
    for _ in range(400):
        plan = pb.StepPlan(step_id=b.last_step_id + 1)
        entries = []
        for slot in rng.sample(live_slots, rng.randint(1, min(6, len(live_slots)))):
            rid = b.inputs.request_ids[slot]
            todo = int(b.inputs.num_tokens[slot] - b.inputs.num_computed_tokens[slot])
            e = Cached(rid, max(0, todo + rng.choice([0, 0, 0, -1, 1])))
            if rng.random() < 0.3:
                e.new_block_ids = rng.choice([[1], [2, 3], [-1], [b.limits.num_blocks]])
            if rng.random() < 0.1:
                held = blocks_of(b.inputs, rid)
                e.block_table = held[: len(held) + rng.choice([-1, 0, 1])]
            entries.append((slot, e))
        fault = rng.random()
        if fault < 0.05:
            entries.append((entries[0][0], Cached("")))  # twice
        elif fault < 0.1:
            entries.append((free_slot, Cached("")))  # a slot that holds nothing
        elif fault < 0.15:
            plan.dropped_slots.append(entries[-1][0])
        elif fault < 0.2:
            plan.new_requests.add(slot=entries[0][0], request_id="fresh", prompt_token_ids=[1], block_ids=[0],
                                  num_scheduled_tokens=1)
            plan.dropped_slots.append(entries[0][0])
        elif fault < 0.25:
            entries.append((b.inputs.num_rows + 5, Cached("")))  # beyond the rows
        add_cached(plan, entries)
        try:
            b.check_plan(step_plan(plan), "e")
            ok = True
        except PlanError as e:
            assert isinstance(e, InvalidPlan)
            ok = False
        live = b.inputs.live.copy()
        live[np.array(plan.dropped_slots, dtype=np.int64)] = False
        joining = {r.slot for r in plan.new_requests}
        cached = CachedDeltas.parse(step_plan(plan))
        fast = b._cached_valid(cached, live, joining)
        slow = True
        try:
            b._check_each_cached(cached, live, joining)
        except PlanError:
            slow = False
        assert fast == slow and (ok or not slow), plan
        verdicts.add(fast)
    assert verdicts == {True, False}
