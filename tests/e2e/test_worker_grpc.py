"""The worker in its own process over real gRPC: Describe, health, reflection, hand-written plan
sequences (chunked prefill, preemption by drop, resume by recompute, reset_batch), bad plans that
must be rejected with the right status and change nothing, and forgetting finished requests.

One worker process serves the whole module, so step ids keep increasing across every test, and
every plan carries the same fencing token and the worker's epoch. "Alone" references are the same
prompts run one at a time over the same worker, under fresh request ids.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from common.worker_protocol import PACKAGE
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.plans import UNKNOWN_SLOT, Cached, Token, Wire, add_cached

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICE = f"{PACKAGE}.Worker"
START_TIMEOUT_S = 120
RPC_TIMEOUT_S = 60

NUM_BLOCKS = 64
BLOCK_SIZE = 16
VOCAB = 49152
FENCE = 7  # every plan in this module carries it; the first accepted plan raises the worker's floor to it
MAX_TOKENS = 12

# Token ids of short English/code prompts under the bundled SmolLM2 tokenizer (fixed here so this module
# does not depend on the scheduler's tokenizer).
PROMPT_A = [504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314]  # 13: "The capital of France ..."
PROMPT_B = [788, 253, 7490, 281, 260, 2118, 665, 4161, 253, 11127, 3333, 30, 3349, 253, 28162, 28, 16528, 28,
            5793, 7490, 28, 4412, 351, 260, 6947]  # 25: "In a hole in the ground there lived a hobbit. ..."
PROMPT_C = [1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003]  # 15: "def fibonacci(n): ..."
PROMPT_E = [65, 42, 1812, 314, 260, 16891, 1225, 282, 913, 418, 3426, 1106, 281, 20590, 47, 198, 49, 42]  # 18: "Q: ..."
PROMPT_F = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 975]  # 10: "The quick brown fox ..."
PROMPT_H = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28]  # 14: "1, 2, 3, 4, 5,"
PROMPT_P = [6403, 1980, 253, 655]  # 4: "Once upon a time"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Req:
    """The scheduler's view of one request."""

    rid: str
    prompt: list[int]
    max_tokens: int = MAX_TOKENS
    tokens: list[int] = field(default_factory=list)  # prompt + output so far
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    finish: int = pb.FINISH_REASON_NONE

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def sampling(self) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=self.max_tokens)


@dataclass
class Result:
    """A step's result with its tokens read by request id."""

    raw: pb.StepResult
    tokens: list[Token]

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


class Worker:
    """A gRPC stub plus a tiny hand scheduler's bookkeeping: free blocks, live requests, slots, step ids."""

    def __init__(self, channel: grpc.Channel, epoch: str):
        self.channel = channel
        self.stub = pb_grpc.WorkerStub(channel)
        self.epoch = epoch
        self.free = list(range(NUM_BLOCKS))[::-1]  # pop() hands out low ids first; freed blocks go to the front
        self.live: dict[str, Req] = {}
        self.wire = Wire()
        self._step = 0
        self._ids = itertools.count()
        self._alone: dict[tuple, list[int]] = {}

    def fresh_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def describe(self) -> pb.WorkerInfo:
        return self.stub.Describe(pb.DescribeRequest(), timeout=RPC_TIMEOUT_S)

    def plan(self, **kw) -> pb.StepPlan:
        """A plan with the next step id, the module's fencing token and the worker's epoch unless given."""
        if "step_id" not in kw:
            self._step += 1
            kw["step_id"] = self._step
        kw.setdefault("fencing_token", FENCE)
        kw.setdefault("expected_epoch", self.epoch)
        return self.wire.plan(**kw)

    def at_slot(self, slot: int, n: int = 0, **kw) -> pb.StepPlan:
        """A plan with one cached entry for whatever `slot` holds."""
        plan = self.plan(**kw)
        add_cached(plan, [(slot, Cached("", n))])
        return plan

    def free_slot(self) -> int:
        """A slot beyond every one handed out: the worker holds nothing there."""
        return len(self.wire.slots.owner) + 1

    # -- deltas: each one updates the scheduler's bookkeeping as if the plan will be accepted ------------

    def _grow(self, r: Req, n: int) -> list[int]:
        need = ceil_div(r.computed + n, BLOCK_SIZE) - len(r.blocks)
        new = [self.free.pop() for _ in range(max(0, need))]
        r.blocks += new
        return new

    def new(self, r: Req, n: int | None = None) -> pb.NewRequest:
        n = len(r.prompt) if n is None else n
        self._grow(r, n)
        r.computed += n
        self.live[r.rid] = r
        return pb.NewRequest(request_id=r.rid, prompt_token_ids=r.prompt, sampling=r.sampling(),
                             block_ids=r.blocks, num_scheduled_tokens=n)

    def cached(self, r: Req, n: int | None = None) -> Cached:
        n = len(r.tokens) - r.computed if n is None else n
        new_blocks = self._grow(r, n)
        r.computed += n
        return Cached(r.rid, n, new_blocks)

    def release(self, r: Req) -> str:
        """Preempt or forget: free the blocks, forget what was computed; the worker must be told to drop it."""
        self.free[:0] = r.blocks
        r.blocks, r.computed = [], 0
        self.live.pop(r.rid, None)
        return r.rid

    def resumed(self, r: Req) -> pb.ResumedRequest:
        """Rebuild by recompute: every known token, a fresh block table, nothing computed."""
        assert r.computed == 0 and not r.blocks
        n = len(r.tokens)
        self._grow(r, n)
        r.computed = n
        self.live[r.rid] = r
        return pb.ResumedRequest(request_id=r.rid, token_ids=r.tokens, num_prompt_tokens=len(r.prompt),
                                 sampling=r.sampling(), block_ids=r.blocks, num_computed_tokens=0,
                                 num_scheduled_tokens=n)

    # -- RPCs ------------------------------------------------------------------------------------------

    def execute(self, plan: pb.StepPlan) -> Result:
        raw = self.stub.ExecuteStep(plan, timeout=RPC_TIMEOUT_S)
        assert raw.step_id == plan.step_id
        assert raw.num_scheduled_tokens == (sum(r.num_scheduled_tokens for r in plan.new_requests)
                                            + sum(r.num_scheduled_tokens for r in plan.resumed_requests)
                                            + sum(plan.cached.num_scheduled_tokens))
        res = Result(raw, self.wire.tokens(raw))
        for t in res.tokens:
            r = self.live[t.request_id]
            assert r.computed == len(r.tokens), f"{r.rid} sampled before its chunk reached its last token"
            r.tokens.append(t.token_id)
            if t.finish_reason:
                r.finish = t.finish_reason
                self.release(r)
        return res

    def reject(self, plan: pb.StepPlan) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as ei:
            self.stub.ExecuteStep(plan, timeout=RPC_TIMEOUT_S)
        return ei.value

    def assert_known(self, r: Req) -> None:
        """Ask whether the worker still holds `r` without changing anything: cached deltas are checked in plan
        order, so a plan with a no-op delta for `r` and then one for a slot that holds nothing fails on whichever
        is unknown first, and a rejected plan changes nothing."""
        err = self.reject(self.plan(cached_requests=[Cached(r.rid), Cached(self.fresh_id("ghost"))]))
        assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"slot {UNKNOWN_SLOT} holds no request")

    def finish(self, *reqs: Req) -> None:
        """Decode the given live requests together until all have finished."""
        for _ in range(4 * MAX_TOKENS * len(reqs) + 64):
            running = [r for r in reqs if not r.finish]
            if not running:
                return
            self.execute(self.plan(cached_requests=[self.cached(r) for r in running]))
        raise AssertionError("requests did not finish")

    def alone(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """Greedy output of `prompt` run by itself (fresh request id, whole prompt in one step); memoised."""
        key = (tuple(prompt), max_tokens)
        if key not in self._alone:
            r = Req(self.fresh_id("alone"), prompt, max_tokens)
            self.execute(self.plan(new_requests=[self.new(r)]))
            self.finish(r)
            assert r.finish == pb.FINISH_REASON_MAX_TOKENS and len(r.output) == max_tokens
            self._alone[key] = r.output
        return self._alone[key]


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, *needles: str) -> None:
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    for n in needles:
        assert n in err.details(), f"{n!r} not in {err.details()!r}"


# -- the worker process --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():
    proc = cluster.start_worker(["--num-gpu-blocks-override", NUM_BLOCKS, "--block-size", BLOCK_SIZE,
                                 "--device", "cpu"], timeout=START_TIMEOUT_S)
    channel = grpc.insecure_channel(proc.address)
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield Worker(channel, proc.epoch)
    finally:
        channel.close()
        rc = cluster.stop(proc, timeout=30)
    assert rc == 0, f"worker exited with {rc} after SIGTERM (SIGKILL after 30 s):\n{proc.log_tail()}"


# -- handshake ----------------------------------------------------------------------------------------


def test_describe_health_and_reflection(worker):
    info = worker.describe()
    m = info.model
    assert "smollm2" in m.name.lower()
    assert m.architecture == "llama"
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 9, 3, 64, VOCAB)
    assert m.path.endswith(".gguf")
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.block_size, info.num_blocks, info.max_model_len) == (BLOCK_SIZE, NUM_BLOCKS, 8192)
    assert info.kv_bytes_per_block == 2 * 30 * 3 * 64 * BLOCK_SIZE * 4  # K and V, float32
    assert info.epoch and info.epoch == worker.epoch  # Describe agrees with the ready line

    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service

    db = ProtoReflectionDescriptorDatabase(worker.channel)
    services = db.get_services()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    svc = DescriptorPool(db).FindServiceByName(SERVICE)
    assert {meth.name for meth in svc.methods} == {"Describe", "ExecuteStep", "PrepareConstraint", "LoadLoraAdapter"}
    assert svc.methods_by_name["ExecuteStep"].input_type.full_name == "llmserve.worker.v2.StepPlan"


# -- plan sequences -----------------------------------------------------------------------------------


def test_chunked_prefill_preemption_and_resume_match_alone(worker):
    ref_a, ref_b = worker.alone(PROMPT_A), worker.alone(PROMPT_B)
    a, b = Req(worker.fresh_id("A"), PROMPT_A), Req(worker.fresh_id("B"), PROMPT_B)

    # Step 1: A's whole prompt; only B's first 5 prompt tokens, so only A samples.
    res = worker.execute(worker.plan(new_requests=[worker.new(a), worker.new(b, 5)]))
    assert [t.request_id for t in res.tokens] == [a.rid]
    assert (len(a.blocks), len(b.blocks), b.computed) == (1, 1, 5)

    # Step 2: A decodes; B's other 20 prompt tokens cross into a second block, and B samples its first token.
    da, db = worker.cached(a), worker.cached(b)
    assert (list(da.new_block_ids), len(db.new_block_ids), db.num_scheduled_tokens) == ([], 1, 20)
    res = worker.execute(worker.plan(cached_requests=[da, db]))
    assert sorted(t.request_id for t in res.tokens) == sorted([a.rid, b.rid])

    # Decode both until A has 5 outputs; A's 17th token opens its second block on the way.
    grew = []
    while len(a.output) < 5:
        da, db = worker.cached(a), worker.cached(b)
        grew += [r.rid for r, d in ((a, da), (b, db)) if d.new_block_ids]
        worker.execute(worker.plan(cached_requests=[da, db]))
    assert grew == [a.rid] and len(a.blocks) == 2

    # Preempt A mid-generation: the plan drops it; B carries on alone for two steps.
    old_blocks, a_so_far, a_slot = list(a.blocks), list(a.output), worker.wire.slot(a.rid)
    res = worker.execute(worker.plan(dropped_request_ids=[worker.release(a)], cached_requests=[worker.cached(b)]))
    assert [t.request_id for t in res.tokens] == [b.rid] and list(res.raw.slots) == [worker.wire.slot(b.rid)]
    err = worker.reject(worker.at_slot(a_slot, 1))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"slot {a_slot} holds no request")
    worker.execute(worker.plan(cached_requests=[worker.cached(b)]))

    # Resume A: prompt + outputs so far, a new block table, recompute from 0, next to B's decode.
    ra = worker.resumed(a)
    assert list(ra.token_ids) == PROMPT_A + a_so_far and ra.num_prompt_tokens == len(PROMPT_A)
    assert ra.num_scheduled_tokens == len(PROMPT_A) + 5 and len(ra.block_ids) == 2
    assert set(ra.block_ids).isdisjoint(old_blocks)
    res = worker.execute(worker.plan(resumed_requests=[ra], cached_requests=[worker.cached(b)]))
    assert sorted(t.request_id for t in res.tokens) == sorted([a.rid, b.rid])

    # Two more decodes: B's 33rd token opens its third block; then both run to the end.
    grew = []
    for _ in range(2):
        da, db = worker.cached(a), worker.cached(b)
        grew += [r.rid for r, d in ((a, da), (b, db)) if d.new_block_ids]
        worker.execute(worker.plan(cached_requests=[da, db]))
    assert grew == [b.rid] and len(b.blocks) == 3
    worker.finish(a, b)
    assert a.finish == b.finish == pb.FINISH_REASON_MAX_TOKENS
    assert a.output == ref_a
    assert b.output == ref_b
    assert not worker.live


def test_reset_batch_forgets_everything(worker):
    ref_h = worker.alone(PROMPT_H)
    g, g2 = Req(worker.fresh_id("G"), PROMPT_F), Req(worker.fresh_id("G2"), PROMPT_F)
    worker.execute(worker.plan(new_requests=[worker.new(g, 6), worker.new(g2, 6)]))  # in flight, mid-prefill
    g2_slot = worker.wire.slot(g2.rid)
    worker.release(g)
    worker.release(g2)
    h = Req(worker.fresh_id("H"), PROMPT_H)
    res = worker.execute(worker.plan(reset_batch=True, new_requests=[worker.new(h)]))
    assert [t.request_id for t in res.tokens] == [h.rid] and worker.wire.slot(h.rid) == 0  # slots start over
    err = worker.reject(worker.at_slot(g2_slot, 4))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"slot {g2_slot} holds no request")
    worker.finish(h)  # what the reset plan brought in lives on
    assert h.output == ref_h


# -- bad plans: right status, a message naming the offender, and no state change -----------------------


@pytest.fixture(scope="module")
def inflight(worker):
    """C decodes one token per valid step (max_tokens 32 outlasts every bad case); E is parked after a
    5-token chunk of its 18-token prompt and is the target of the bad cached deltas."""
    worker.alone(PROMPT_C, 32)  # references first, so the in-flight pair's blocks stay put meanwhile
    worker.alone(PROMPT_E)
    c, e = Req(worker.fresh_id("C"), PROMPT_C, 32), Req(worker.fresh_id("E"), PROMPT_E)
    res = worker.execute(worker.plan(new_requests=[worker.new(c), worker.new(e, 5)]))
    assert [t.request_id for t in res.tokens] == [c.rid]
    return c, e


@dataclass
class Ctx:
    worker: Worker
    plan: pb.StepPlan  # a valid plan (a probe new request and C's decode) for the case to spoil
    c: Req
    e: Req
    last_step_id: int

    def spare_block(self) -> int:
        return self.worker.free[0]  # looked at, not allocated: the plan is meant to be rejected

    def slot(self, r: Req) -> int:
        return self.worker.wire.slot(r.rid)

    def free_slot(self) -> int:
        return self.worker.free_slot()

    def bad_id(self, what: str) -> str:
        return self.worker.fresh_id(what)


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def _unknown_cached(x: Ctx):
    slot = x.free_slot()
    add_cached(x.plan, [(slot, Cached("", 1))])
    return INVALID, [f"slot {slot}", "holds no request"]


def _slot_out_of_range_new(x: Ctx):
    x.plan.new_requests.add(slot=1 << 20, request_id=x.bad_id("far"), prompt_token_ids=PROMPT_P)
    return INVALID, [f"slot {1 << 20}", "not below 16384"]


def _cached_arrays_of_different_lengths(x: Ctx):
    x.plan.cached.num_scheduled_tokens.append(1)
    return INVALID, ["num_scheduled_tokens has 2 entries, slots 1"]


def _new_block_counts_not_matching(x: Ctx):
    x.plan.cached.new_block_ids.append(x.spare_block())
    return INVALID, ["num_new_blocks add up to 0", "new_block_ids has 1"]


def _replaced_table_of_a_slot_not_cached(x: Ctx):
    x.plan.replaced_tables.add(slot=x.slot(x.e), block_ids=[x.spare_block()])
    return INVALID, [f"replaced_tables[slot {x.slot(x.e)}]", "not among the cached"]


def _block_64_new(x: Ctx):
    rid = x.bad_id("blk")
    x.plan.new_requests.add(slot=x.free_slot(), request_id=rid, prompt_token_ids=PROMPT_P, block_ids=[NUM_BLOCKS],
                            num_scheduled_tokens=len(PROMPT_P))
    return INVALID, [rid, f"block id {NUM_BLOCKS}", f"[0, {NUM_BLOCKS})"]


def _block_huge_resumed(x: Ctx):
    rid = x.bad_id("blk")
    x.plan.resumed_requests.add(slot=x.free_slot(), request_id=rid, token_ids=PROMPT_P,
                                num_prompt_tokens=len(PROMPT_P), block_ids=[x.spare_block(), 10**6],
                                num_scheduled_tokens=len(PROMPT_P))
    return INVALID, [rid, "block id 1000000", f"[0, {NUM_BLOCKS})"]


def _block_negative_cached(x: Ctx):
    add_cached(x.plan, [(x.slot(x.e), Cached(x.e.rid, 0, [-1]))])
    return INVALID, [x.e.rid, "block id -1", f"[0, {NUM_BLOCKS})"]


def _step_id_repeated(x: Ctx):
    x.plan.step_id = x.last_step_id
    return PRECONDITION, ["step_id", str(x.last_step_id)]


def _step_id_older(x: Ctx):
    x.plan.step_id = x.last_step_id - 1
    return PRECONDITION, ["step_id", str(x.last_step_id - 1), str(x.last_step_id)]


def _fencing_older(x: Ctx):
    x.plan.fencing_token = FENCE - 1
    return PRECONDITION, ["fencing_token", str(FENCE - 1), str(FENCE)]


def _wrong_epoch(x: Ctx):
    x.plan.expected_epoch = "stale" + x.worker.epoch
    return PRECONDITION, ["expected_epoch", "stale" + x.worker.epoch, x.worker.epoch]


def _duplicate_in_plan(x: Ctx):
    rid, slot = x.bad_id("dup"), x.free_slot()
    for _ in range(2):
        x.plan.new_requests.add(slot=slot, request_id=rid, prompt_token_ids=PROMPT_P)
    return INVALID, [rid, f"slot {slot} joins more than once"]


def _duplicate_of_live(x: Ctx):
    x.plan.new_requests.add(slot=x.free_slot(), request_id=x.e.rid, prompt_token_ids=PROMPT_P)
    return INVALID, [x.e.rid, f"already on this worker in slot {x.slot(x.e)}"]


def _slot_of_live(x: Ctx):
    rid = x.bad_id("taker")
    x.plan.new_requests.add(slot=x.slot(x.e), request_id=rid, prompt_token_ids=PROMPT_P)
    return INVALID, [rid, f"slot {x.slot(x.e)} still holds request {x.e.rid!r}"]


def _beyond_known_new(x: Ctx):
    rid = x.bad_id("long")
    x.plan.new_requests.add(slot=x.free_slot(), request_id=rid, prompt_token_ids=PROMPT_P,
                            block_ids=[x.spare_block()], num_scheduled_tokens=len(PROMPT_P) + 1)
    return INVALID, [rid, "exceeds", f"{len(PROMPT_P)} known tokens"]


def _beyond_known_cached(x: Ctx):
    add_cached(x.plan, [(x.slot(x.e), Cached(x.e.rid, 14, [x.spare_block()]))])
    return INVALID, [x.e.rid, "exceeds", "18 known tokens"]


def _too_few_blocks_new(x: Ctx):
    rid = x.bad_id("short")
    x.plan.new_requests.add(slot=x.free_slot(), request_id=rid, prompt_token_ids=PROMPT_E,
                            block_ids=[x.spare_block()], num_scheduled_tokens=len(PROMPT_E))
    return INVALID, [rid, "need 2 blocks", "has 1"]


def _too_few_blocks_cached(x: Ctx):
    add_cached(x.plan, [(x.slot(x.e), Cached(x.e.rid, 13))])  # 5 + 13 tokens, no second block
    return INVALID, [x.e.rid, "need 2 blocks", "has 1"]


def _token_outside_vocab_new(x: Ctx):
    rid = x.bad_id("vocab")
    x.plan.new_requests.add(slot=x.free_slot(), request_id=rid, prompt_token_ids=[*PROMPT_P, VOCAB],
                            block_ids=[x.spare_block()], num_scheduled_tokens=len(PROMPT_P) + 1)
    return INVALID, [rid, f"token id {VOCAB}", f"[0, {VOCAB})"]


def _negative_token_resumed(x: Ctx):
    rid = x.bad_id("vocab")
    x.plan.resumed_requests.add(slot=x.free_slot(), request_id=rid, token_ids=[*PROMPT_P, -5],
                                num_prompt_tokens=len(PROMPT_P), block_ids=[x.spare_block()],
                                num_scheduled_tokens=len(PROMPT_P) + 1)
    return INVALID, [rid, "token id -5"]


def _stop_token_outside_vocab_new(x: Ctx):
    # min_tokens > 0 makes the sampler ban the stop ids by indexing the logits with them.
    rid = x.bad_id("stop")
    x.plan.new_requests.add(slot=x.free_slot(), request_id=rid, prompt_token_ids=PROMPT_P,
                            block_ids=[x.spare_block()], num_scheduled_tokens=len(PROMPT_P),
                            sampling=pb.SamplingParams(stop_token_ids=[VOCAB + 5], min_tokens=2, max_tokens=4))
    return INVALID, [rid, f"{VOCAB + 5}", f"[0, {VOCAB})"]


def _logprobs_beyond_vocab_resumed(x: Ctx):
    rid = x.bad_id("lp")
    x.plan.resumed_requests.add(slot=x.free_slot(), request_id=rid, token_ids=PROMPT_P,
                                num_prompt_tokens=len(PROMPT_P), block_ids=[x.spare_block()],
                                num_scheduled_tokens=len(PROMPT_P),
                                sampling=pb.SamplingParams(logprobs=VOCAB + 1, max_tokens=4))
    return INVALID, [rid, "logprobs", f"{VOCAB + 1}"]


def _cached_after_drop_in_same_plan(x: Ctx):
    x.plan.dropped_slots.append(x.slot(x.e))
    add_cached(x.plan, [(x.slot(x.e), Cached(x.e.rid))])
    return INVALID, [f"slot {x.slot(x.e)}", "dropped"]


def _reset_then_cached(x: Ctx):
    x.plan.reset_batch = True  # the plan still carries C's decode, which a reset would orphan
    return INVALID, [f"slot {x.slot(x.c)}", "holds no request"]


BAD_CASES: list[Callable[[Ctx], tuple[grpc.StatusCode, list[str]]]] = [
    _unknown_cached, _slot_out_of_range_new, _cached_arrays_of_different_lengths, _new_block_counts_not_matching,
    _replaced_table_of_a_slot_not_cached, _slot_of_live,
    _block_64_new, _block_huge_resumed, _block_negative_cached, _step_id_repeated, _step_id_older,
    _fencing_older, _wrong_epoch, _duplicate_in_plan, _duplicate_of_live, _beyond_known_new, _beyond_known_cached,
    _too_few_blocks_new, _too_few_blocks_cached, _token_outside_vocab_new, _negative_token_resumed,
    _stop_token_outside_vocab_new, _logprobs_beyond_vocab_resumed, _cached_after_drop_in_same_plan, _reset_then_cached,
]


@pytest.mark.parametrize("spoil", BAD_CASES, ids=[f.__name__.lstrip("_") for f in BAD_CASES])
def test_bad_plan_is_rejected_and_changes_nothing(worker, inflight, spoil):
    c, e = inflight
    before = worker.describe()
    # The valid part: a probe that would finish in one step, and C's next decode (placed before the bad item).
    probe = Req(worker.fresh_id("probe"), PROMPT_P, max_tokens=1)
    valid_new, valid_c = worker.new(probe), worker.cached(c)
    plan = worker.plan(new_requests=[valid_new], cached_requests=[valid_c])
    code, needles = spoil(Ctx(worker, plan, c, e, before.last_step_id))

    assert_status(worker.reject(plan), code, *needles)
    after = worker.describe()
    assert (after.last_step_id, after.fencing_token, after.epoch) == (before.last_step_id, FENCE, worker.epoch)

    worker.assert_known(e)  # E, parked, is still on the worker (not dropped or reset by the rejected plan)

    # Re-sent with a fresh step id, the valid part is accepted as if the bad plan never came: the probe is
    # new to the worker (not "already exists"), and C advances by exactly one token.
    n_out = len(c.output)
    res = worker.execute(worker.plan(new_requests=[valid_new], cached_requests=[valid_c]))
    assert sorted(t.request_id for t in res.tokens) == sorted([probe.rid, c.rid])
    assert probe.finish == pb.FINISH_REASON_MAX_TOKENS and len(c.output) == n_out + 1
    assert worker.describe().last_step_id == res.step_id


def test_rejected_plans_left_inflight_requests_intact(worker, inflight):
    c, e = inflight
    # E is still parked after its first chunk, on one block: no rejected plan dropped, grew or advanced it.
    de = worker.cached(e)
    assert (de.num_scheduled_tokens, len(de.new_block_ids)) == (13, 1)
    worker.execute(worker.plan(cached_requests=[worker.cached(c), de]))
    worker.finish(c, e)
    assert c.output == worker.alone(PROMPT_C, 32)
    assert e.output == worker.alone(PROMPT_E)
    assert not worker.live


# -- finished requests ----------------------------------------------------------------------------------


def test_finished_request_is_forgotten(worker):
    f = Req(worker.fresh_id("F"), PROMPT_F, max_tokens=3)
    worker.execute(worker.plan(new_requests=[worker.new(f)]))
    f_slot = worker.wire.slot(f.rid)
    worker.finish(f)
    assert f.finish == pb.FINISH_REASON_MAX_TOKENS and len(f.output) == 3

    err = worker.reject(worker.at_slot(f_slot))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"slot {f_slot} holds no request")

    # Dropping its slot (or one never given) is a harmless no-op, on its own or next to live work; the freed slot
    # is given to the next request.
    plan = worker.plan()
    plan.dropped_slots.extend([f_slot, UNKNOWN_SLOT])
    res = worker.execute(plan)
    assert not res.tokens and res.num_scheduled_tokens == 0
    assert worker.describe().last_step_id == res.step_id
    h = Req(worker.fresh_id("H"), PROMPT_H)
    plan = worker.plan(new_requests=[worker.new(h)])
    plan.dropped_slots.append(f_slot)
    assert plan.new_requests[0].slot == f_slot
    res = worker.execute(plan)
    assert [t.request_id for t in res.tokens] == [h.rid]
    worker.finish(h)
    assert h.output == worker.alone(PROMPT_H)


def test_pipelined_plans_run_in_order_and_skip_a_request_the_step_before_finished(worker):
    """Plan k+1 (after_step_id = k) that reaches the worker before plan k waits for k and runs after it, and its
    entry for a request k finished (the scheduler planned it before it knew) is skipped, not an error."""
    want = worker.alone(PROMPT_H)
    short, long = Req(worker.fresh_id("S"), PROMPT_F, max_tokens=1), Req(worker.fresh_id("L"), PROMPT_H)
    plan_k = worker.plan(new_requests=[worker.new(short), worker.new(long)])
    # What a pipelined scheduler sends next: one more token for both, before knowing that `short` is done.
    plan_k1 = worker.plan(cached_requests=[worker.cached(short, 1), worker.cached(long, 1)],
                          after_step_id=plan_k.step_id)
    last = worker.describe().last_step_id
    second = worker.stub.ExecuteStep.future(plan_k1, timeout=RPC_TIMEOUT_S)
    time.sleep(0.5)  # k+1 is there first, and must wait
    first = worker.stub.ExecuteStep.future(plan_k, timeout=RPC_TIMEOUT_S)
    res_k, res_k1 = first.result(), second.result()
    assert res_k.previous_step_id == last and res_k1.previous_step_id == plan_k.step_id
    short_slot = worker.wire.slot(short.rid)
    tokens_k, tokens_k1 = worker.wire.tokens(res_k), worker.wire.tokens(res_k1)
    assert [t.request_id for t in tokens_k] == [short.rid, long.rid]
    assert tokens_k[0].finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert [t.request_id for t in tokens_k1] == [long.rid] and res_k1.num_scheduled_tokens == 1
    long.tokens += [tokens_k[1].token_id, tokens_k1[0].token_id]
    worker.release(short)
    worker.finish(long)
    assert long.output == want, "the pipelined decode changed the text"
    # Without after_step_id (or naming another step) the same stale entry is refused as before.
    err = worker.reject(worker.at_slot(short_slot, 1))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"slot {short_slot} holds no request")


def test_a_plan_pipelined_behind_a_refused_one_is_refused(worker):
    """Plan k+1 was built on top of plan k's slots: when k is refused, k+1 must not run on what the worker has."""
    a = Req(worker.fresh_id("A"), PROMPT_F)
    bad = worker.plan(new_requests=[worker.new(a)], fencing_token=FENCE - 1)
    behind = worker.plan(cached_requests=[worker.cached(a, 1)], after_step_id=bad.step_id)
    assert_status(worker.reject(bad), grpc.StatusCode.FAILED_PRECONDITION, "fencing_token")
    err = worker.reject(behind)
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, f"step {bad.step_id}", "refused")
    assert dict(err.trailing_metadata())["llmserve-plan-error"] == "predecessor_refused"
    worker.release(a)
    worker.wire.slots.clear()  # as the scheduler does after a failed step: the next plan resets the batch
    worker.execute(worker.plan(reset_batch=True))


def test_a_peer_of_the_previous_protocol_version_is_refused(worker):
    """A v1 scheduler's call names a service this worker does not serve: UNIMPLEMENTED, nothing decoded."""
    for method in ("Describe", "ExecuteStep"):
        call = worker.channel.unary_unary(f"/llmserve.worker.v1.Worker/{method}")
        with pytest.raises(grpc.RpcError) as ei:
            call(b"", timeout=RPC_TIMEOUT_S)
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
