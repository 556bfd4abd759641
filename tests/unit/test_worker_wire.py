"""The scheduler's edge of the v2 worker protocol: the slot table, plans encoded as packed arrays, results decoded
by slot, refusals mapped back to the request at fault, and a worker of another protocol version refused."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from common import plan_errors
from common.sampling_fields import SamplingParams
from common.validation import ConfigError
from protos import worker_pb2 as wpb
from scheduler_svc.core.request import Request
from scheduler_svc.core.slot_table import SlotTable
from scheduler_svc.core.step_records import SchedulerOutput
from scheduler_svc.driver.worker_client import (
    PlanRejected,
    StaleStep,
    WorkerClient,
    WorkerLost,
    _typed_error,
    decode_result,
    encode_plan,
)


def test_slots_are_the_lowest_free_and_reused_after_leaving():
    t = SlotTable(4)
    assert [t.join(r) for r in "abc"] == [0, 1, 2]
    assert t.leave("b") == 1 and t.leave("b") is None  # twice: the second finds nothing
    assert t.join("d") == 1 and t.join("e") == 3
    with pytest.raises(RuntimeError, match="all 4 worker slots are taken"):
        t.join("f")
    with pytest.raises(ValueError, match="already holds slot 0"):
        t.join("a")
    t.leave("a")
    t.leave("c")
    assert t.join("g") == 0 and t.snapshot() == ["g", "d", None, "e"]
    t.clear()
    assert len(t) == 0 and t.join("h") == 0


def test_a_finish_frees_the_slot_only_if_the_request_still_holds_it():
    t = SlotTable(8)
    t.join("a")
    seen_by_step_k = t.snapshot()
    # Pipelined: plan k+1 dropped a (aborted meanwhile) and gave its slot to b, before step k's result came.
    t.leave("a")
    assert t.join("b") == 0
    t.finished(0, seen_by_step_k[0])  # step k's result: a finished in slot 0
    assert t.owner[0] == "b" and t.slot_of == {"b": 0}
    t.finished(0, "b")
    assert t.slot_of == {} and t.join("c") == 0


def _req(rid: str, prompt: list[int], blocks: list[int], **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8), block_ids=blocks, **kw)


def _out(*entries: tuple[Request, int, list[int], int]) -> SchedulerOutput:
    """(request, tokens this step, blocks allocated this step, computed before) per scheduled request."""
    out = SchedulerOutput()
    for req, n, new, before in entries:
        out.scheduled.append(req)
        out.num_tokens[req.request_id] = n
        out.new_blocks[req.request_id] = new
        out.num_computed_before[req.request_id] = before
    return out


def _encode(out: SchedulerOutput, slots: SlotTable, step: int, *, reset=False, dropped=()) -> wpb.StepPlan:
    return encode_plan(out, slots, step_id=step, token=1, epoch="e", reset=reset, dropped=list(dropped))


def test_plans_address_requests_by_slot_in_packed_arrays():
    slots = SlotTable(64)
    a, b = _req("a", [1, 2, 3], [7]), _req("b", [4] * 20, [8, 9])
    plan = _encode(_out((a, 3, [7], 0), (b, 20, [8, 9], 0)), slots, 1, reset=True)
    assert [(r.slot, r.request_id, list(r.block_ids)) for r in plan.new_requests] == [(0, "a", [7]), (1, "b", [8, 9])]
    assert a.on_worker and b.on_worker and not plan.cached.slots

    # A decode-only step: slots and counts only, no per-entry message, no block counts when none are new.
    a.output_ids, b.output_ids = [5], [6]
    plan = _encode(_out((a, 1, [], 3), (b, 1, [], 20)), slots, 2)
    assert (list(plan.cached.slots), list(plan.cached.num_scheduled_tokens)) == ([0, 1], [1, 1])
    assert not plan.cached.num_new_blocks and not plan.cached.new_block_ids and not plan.new_requests

    # b crosses into a new block; a's table was replaced by a copy-on-write.
    b.block_ids.append(10)
    a.block_ids = [11]
    out = _out((a, 1, [], 4), (b, 1, [10], 21))
    out.replaced_tables.add("a")
    plan = _encode(out, slots, 3)
    assert list(plan.cached.num_new_blocks) == [0, 1] and list(plan.cached.new_block_ids) == [10]
    assert [(t.slot, list(t.block_ids)) for t in plan.replaced_tables] == [(0, [11])]

    # a is dropped (preempted) and c joins in the same plan: c takes a's slot, freed first.
    a.on_worker = False
    c = _req("c", [1], [12])
    plan = _encode(_out((b, 1, [], 22), (c, 1, [12], 0)), slots, 4, dropped=["a", "gone-already"])
    assert list(plan.dropped_slots) == [0] and [(r.slot, r.request_id) for r in plan.new_requests] == [(0, "c")]
    assert list(plan.cached.slots) == [1]

    # a comes back (resumed, with its output so far) into the lowest free slot.
    a.block_ids = [13]
    plan = _encode(_out((a, 4, [13], 0)), slots, 5)
    assert [(r.slot, list(r.token_ids), r.num_prompt_tokens) for r in plan.resumed_requests] == [(2, [1, 2, 3, 5], 3)]

    # A reset (new leader, failed step) starts the slots over.
    for r in (a, b, c):
        r.on_worker = False
    plan = _encode(_out((b, 1, [], 0)), slots, 6, reset=True)
    assert plan.reset_batch and [r.slot for r in plan.resumed_requests] == [0] and slots.slot_of == {"b": 0}


def test_after_a_failed_step_only_a_reset_plan_may_follow():
    slots = SlotTable(8)
    a = _req("a", [1], [1])
    _encode(_out((a, 1, [1], 0)), slots, 1, reset=True)
    slots.stale = True  # what the client marks when a step's call fails (refused, lost, timed out)
    a.output_ids = [2]
    with pytest.raises(RuntimeError, match="must reset"):
        _encode(_out((a, 1, [], 1)), slots, 2)
    a.on_worker = False
    plan = _encode(_out((a, 2, [1], 0)), slots, 3, reset=True)
    assert not slots.stale and [r.slot for r in plan.resumed_requests] == [0]


def test_results_are_read_by_the_slots_their_plan_gave():
    result = wpb.StepResult(step_id=3, slots=[2, 0], token_ids=[11, 12],
                            finish_reasons=[wpb.FINISH_REASON_NONE, wpb.FINISH_REASON_EOS],
                            logprob_indices=[1], logprobs=[-0.5], num_top_logprobs=[2],
                            top_logprob_token_ids=[12, 13], top_logprobs=[-0.5, -1.5], forward_seconds=0.25)
    out = decode_result(result, ["x", None, "y"])
    assert [(t.request_id, t.token_id, t.finish) for t in out.tokens] == [("y", 11, None), ("x", 12, "eos")]
    assert out.tokens[0].logprobs is None
    lp = out.tokens[1].logprobs
    assert lp.logprob == -0.5 and [(t, round(v, 3)) for t, v in lp.top] == [(12, -0.5), (13, -1.5)]
    assert out.forward_seconds == 0.25
    plain = decode_result(wpb.StepResult(slots=[0], token_ids=[5]), ["x"])
    assert [(t.request_id, t.finish, t.logprobs) for t in plain.tokens] == [("x", None, None)]


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, metadata: tuple):
        self._code, self._metadata = code, metadata

    def code(self):
        return self._code

    def details(self):
        return "refused"

    def trailing_metadata(self):
        return self._metadata


def test_a_refusal_names_the_request_in_the_slot_the_worker_names():
    owners = ["a", "b"]
    bad = ((plan_errors.REASON_KEY, plan_errors.INVALID), (plan_errors.SLOT_KEY, "1"))
    err = _typed_error(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, bad), owners)
    assert isinstance(err, PlanRejected) and err.request_id == "b"
    # The worker's own request id wins (a new entry's id; the slot may be one the worker never saw).
    named = (*bad, (plan_errors.REQUEST_ID_KEY, "n"))
    assert _typed_error(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, named), owners).request_id == "n"
    nowhere = ((plan_errors.REASON_KEY, plan_errors.INVALID), (plan_errors.SLOT_KEY, "9"))
    assert _typed_error(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, nowhere), owners).request_id == ""
    behind = ((plan_errors.REASON_KEY, plan_errors.PREDECESSOR_REFUSED),)
    assert isinstance(_typed_error(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, behind), owners), WorkerLost)
    # A step id the worker already ran (another scheduler's step won a take-over race): still a lost call, told
    # apart so that the driver logs the race as the routine retry it is.
    stale = _typed_error(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, ((plan_errors.REASON_KEY,
                                                                           plan_errors.STALE_STEP),)), owners)
    assert isinstance(stale, StaleStep) and isinstance(stale, WorkerLost)
    assert not isinstance(_typed_error(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, behind), owners), StaleStep)


def test_a_worker_of_another_protocol_version_is_refused_with_a_clear_error():
    """A v1 worker serves llmserve.worker.v1.Worker only: our Describe is UNIMPLEMENTED there, which is a
    configuration error (stop and say so), not a worker to wait for."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    v1 = grpc.method_handlers_generic_handler("llmserve.worker.v1.Worker", {
        "Describe": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"", request_deserializer=bytes,
                                                        response_serializer=bytes)})
    server.add_generic_rpc_handlers((v1,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = WorkerClient(f"127.0.0.1:{port}")
        with pytest.raises(ConfigError, match=r"does not serve llmserve\.worker\.v2\.Worker .*UNIMPLEMENTED.*"
                                              r"another version of the worker protocol"):
            client.describe(timeout=10)
        client.channel.close()
    finally:
        server.stop(None)
