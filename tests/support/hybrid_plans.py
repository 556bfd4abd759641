"""The scheduler core of a hybrid model driven through the real plan encoding and wire conversion against a
recorder of recurrent state (tests/unit/test_state_slots.py, tests/service/test_state_ledger.py).

The recorder stands for the worker's state pool with an exact state: slot -> the tuple of tokens it has absorbed.
It applies a plan in the contract's order (state copies, zeroing of fresh joiners, the forward, state saves) and
asserts before each chunk that the request's slot holds exactly the tokens before the chunk: a snapshot restored at
the wrong position, a slot shared by two requests, a missed copy or a stale slot all show up as a wrong state. Its
"model" samples a pure function of the state, so every output is known in advance.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from protos import llmserve_pb2 as pb
from protos import worker_pb2 as wpb
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.slot_table import SlotTable
from scheduler_svc.core.state_pool import StateSlotPool
from scheduler_svc.core.step_records import WORKER_MAX_TOKENS, SampledToken, StepCommit, WorkerOutput
from scheduler_svc.driver.admission import Limits, build_requests
from scheduler_svc.driver.worker_client import encode_plan
from scheduler_svc.ledger.codec import CommitEncoder
from worker_svc.wire import skip_finished_requests, step_plan

BS = 16
VOCAB = 500


def toks(n: int, base: int = 1) -> list[int]:
    return [(base * 37 + i * 11) % (VOCAB - 2) + 1 for i in range(n)]


def next_token(state: tuple[int, ...], seed: int) -> int:
    return zlib.crc32(repr((seed, state)).encode()) % (VOCAB - 2) + 1


def expected_output(prompt: list[int], max_tokens: int, seed: int = 0) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(tuple(seq), seed))
    return seq[len(prompt):]


class StateRecorder:
    """The worker's batch and state slots, reduced to what the scheduler's plans must get right."""

    def __init__(self, num_slots: int):
        self.state: dict[int, tuple[int, ...] | None] = dict.fromkeys(range(num_slots))  # None: never written
        self.batch: dict[int, dict] = {}  # batch slot -> tokens, state slot, computed, prompt length, limits
        self.copies = self.saves = 0
        self.finished_last: set[int] = set()  # batch slots the last step finished (a pipelined plan may name them)

    def execute_wire(self, plan: wpb.StepPlan) -> WorkerOutput:
        """The wire plan as the worker's server takes it: entries of requests the step before finished dropped."""
        skip_finished_requests(plan, self.finished_last)
        return self.execute(step_plan(plan))

    def execute(self, plan) -> WorkerOutput:
        if plan.reset_batch:
            self.batch.clear()
        for s in plan.dropped_slots.tolist():
            self.batch.pop(s, None)
        copied = set(plan.state_copy_dst.tolist())
        for src, dst in zip(plan.state_copy_src.tolist(), plan.state_copy_dst.tolist(), strict=True):
            assert self.state[src] is not None, f"copy from state slot {src}, never written"
            self.state[dst] = self.state[src]
            self.copies += 1
        entries = []
        owners = {seq["state"] for seq in self.batch.values()}
        for j in plan.new_requests + plan.resumed_requests:
            assert j.state_slot >= 0 and j.state_slot not in owners, f"{j.request_id}: state slot {j.state_slot}"
            owners.add(j.state_slot)
            if j.num_computed_tokens == 0:
                self.state[j.state_slot] = ()
            else:
                assert j.state_slot in copied, f"{j.request_id} joins at {j.num_computed_tokens} without a copy"
            self.batch[j.slot] = {"tokens": j.token_ids.tolist(), "state": j.state_slot,
                                  "computed": j.num_computed_tokens, "prompt": j.num_prompt_tokens,
                                  "max_tokens": j.sampling.max_tokens, "rid": j.request_id}
            entries.append((j.slot, j.num_scheduled_tokens))
        entries += zip(plan.cached.slots.tolist(), plan.cached.num_scheduled_tokens.tolist(), strict=True)
        out = WorkerOutput()
        self.finished_last = set()
        for slot, n in entries:
            seq = self.batch[slot]
            c = seq["computed"]
            assert self.state[seq["state"]] == tuple(seq["tokens"][:c]), f"{seq['rid']}: wrong state before {c}"
            seq["computed"] = c + n
            self.state[seq["state"]] = tuple(seq["tokens"][: c + n])
            if c + n == len(seq["tokens"]):
                tok = next_token(self.state[seq["state"]], 0)
                seq["tokens"].append(tok)
                done = len(seq["tokens"]) - seq["prompt"] >= seq["max_tokens"]
                out.tokens.append(SampledToken(seq["rid"], tok, WORKER_MAX_TOKENS if done else None))
                if done:
                    del self.batch[slot]
                    self.finished_last.add(slot)
        for src, dst in zip(plan.state_save_src.tolist(), plan.state_save_dst.tolist(), strict=True):
            self.state[dst] = self.state[src]
            self.saves += 1
        return out


def policy(num_slots: int, **kw) -> PolicyConfig:
    return PolicyConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, "block_size": BS,
                           "num_state_slots": num_slots, **kw})


class Stack:
    """The core, the real plan encoding and wire conversion, and the recorder; one step at a time."""

    def __init__(self, num_blocks: int = 64, num_slots: int = 6, share: float = 0.5,
                 commit: Callable[[StepCommit], None] | None = None, **kw):
        self.policy = policy(num_slots, state_snapshot_share=share, **kw)
        self.core = SchedulerCore(self.policy, BlockPool(num_blocks),
                                  states=StateSlotPool(num_slots, self.policy.max_state_snapshots))
        self.slots = SlotTable(64)
        self.worker = StateRecorder(num_slots)
        self.commit = commit or CommitEncoder().encode  # a ledger's commit, or the payload encoding alone
        self.step_id = 0
        self.preemptions = self.hits = 0
        self.max_snapshots_seen = self.max_running = 0
        self.stopped_by: set[str | None] = set()

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> list[Request]:
        g = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt),
                               sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n))
        limits = Limits(max_model_len=1 << 20, vocab_size=VOCAB, kv_pool_tokens=1 << 20, block_size=BS)
        reqs = build_requests(g, prompt, limits, rid)
        self.core.add(reqs)
        return reqs

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not (self.core.has_work or self.core.forks):
                return
            self.step()
        raise AssertionError("did not drain")

    def run_pipelined(self, max_steps: int = 2000) -> None:
        """As the driver with --async-scheduling: step k + 1 is planned (each request assumed to get its token in k)
        and sent before k's result is applied."""
        core, in_flight = self.core, None
        for _ in range(max_steps):
            if not (core.has_work or core.forks or in_flight):
                return
            sent = None
            out = core.schedule(0.0) if core.has_work else None
            if out is not None and out.scheduled:
                self.step_id += 1
                plan = encode_plan(out, self.slots, step_id=self.step_id, token=1, epoch="e",
                                   reset=core.reset_worker, dropped=core.to_drop)
                core.reset_worker, core.to_drop = False, []
                owners = self.slots.snapshot()
                sent = (out, self.worker.execute_wire(plan), owners, self.step_id)
            if in_flight is not None:
                self._apply(*in_flight)
            in_flight = sent
        raise AssertionError("did not drain")

    def _apply(self, out, result: WorkerOutput, owners: list[str | None], step_id: int) -> None:
        core = self.core
        for tok in result.tokens:
            if tok.finish:
                self.slots.finished(owners.index(tok.request_id), tok.request_id)
        core.update_from_output(out, result, 0.0)
        self.preemptions += len(out.preempted)
        self.hits += out.prefix_cache_hits
        core.check_invariant()
        self.max_snapshots_seen = max(self.max_snapshots_seen, core.states.num_snapshots)
        self.commit(core.take_commit(step_id, out, check_invariant=True))

    def step(self) -> None:
        """Schedule, encode, convert, execute, apply, check, commit: one iteration (not pipelined)."""
        core = self.core
        out = core.schedule(0.0)
        self.step_id += 1
        plan = encode_plan(out, self.slots, step_id=self.step_id, token=1, epoch="e", reset=core.reset_worker,
                           dropped=core.to_drop)
        core.reset_worker, core.to_drop = False, []
        result = self.worker.execute(step_plan(plan))
        for tok in result.tokens:
            if tok.finish:
                self.slots.leave(tok.request_id)
        core.update_from_output(out, result, 0.0)
        self.preemptions += len(out.preempted)
        self.max_running = max(self.max_running, len(core.running))
        self.stopped_by.add(out.admission_stopped_by)
        self.hits += out.prefix_cache_hits
        core.check_invariant()
        self.max_snapshots_seen = max(self.max_snapshots_seen, core.states.num_snapshots)
        self.commit(core.take_commit(self.step_id, out, check_invariant=True))
