"""The worker's gRPC edge: only worker_svc/server.py and worker_svc/wire.py speak protobuf and gRPC status codes;
wire.py converts a StepPlan message into the core's plain plan field by field, packs a StepOutput into a StepResult,
and maps each kind of refusal to its status code and trailing metadata."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from common import plan_errors
from protos import worker_pb2 as pb
from tests.unit.test_layering import ROOT, imported_packages, python_files
from worker_svc.core import errors, step_output
from worker_svc.core.step_output import Logprobs, StepOutput
from worker_svc.wire import plan_error_code, plan_error_metadata, step_plan, step_result

WIRE = {"grpc", "grpc_health", "grpc_reflection", "protos", "google"}
# server.py is the gRPC servicer; wire.py holds the conversions (plan, result, sampling record, refusals).
EDGE = {"worker_svc/server.py", "worker_svc/wire.py"}


def test_only_the_edge_imports_the_wire_format():
    wrong = [f"{rel}:{line} imports {name}" for path in python_files("worker_svc")
             if (rel := os.path.relpath(path, ROOT)) not in EDGE
             for line, name in sorted(imported_packages(path)) if name in WIRE]
    assert not wrong, "\n".join(wrong)


def test_finish_codes_are_the_wire_values():
    assert (step_output.FINISH_NONE, step_output.FINISH_EOS, step_output.FINISH_STOP_TOKEN,
            step_output.FINISH_MAX_TOKENS) == (
        pb.FINISH_REASON_NONE, pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_TOKEN, pb.FINISH_REASON_MAX_TOKENS)


def test_a_plan_converts_field_by_field():
    msg = pb.StepPlan(step_id=7, fencing_token=3, expected_epoch="e", reset_batch=True, dropped_slots=[4, 5],
                      prompt_lookup_min=1, prompt_lookup_max=3)
    msg.new_requests.add(slot=1, request_id="a", prompt_token_ids=[5, 6, 7],
                         sampling=pb.SamplingParams(temperature=0.5, seed=9, logprobs=2, stop_token_ids=[3]),
                         block_ids=[10], num_computed_tokens=1, num_scheduled_tokens=2)
    msg.resumed_requests.add(slot=2, request_id="b", token_ids=[1, 2, 3, 4], num_prompt_tokens=2,
                             sampling=pb.SamplingParams(), block_ids=[11, 12], num_scheduled_tokens=4)
    msg.cached.slots.extend([0, 3])
    msg.cached.num_scheduled_tokens.extend([1, 1])
    msg.cached.num_new_blocks.extend([0, 1])
    msg.cached.new_block_ids.append(13)
    msg.cached.num_draft_slots.extend([2, 0])
    msg.replaced_tables.add(slot=3, block_ids=[14, 15])
    msg.copy_blocks.add(src=14, dst=16)
    p = step_plan(msg)
    assert (p.step_id, p.fencing_token, p.expected_epoch, p.reset_batch, p.dropped_slots.tolist()) == (
        7, 3, "e", True, [4, 5])
    new, resumed = p.new_requests[0], p.resumed_requests[0]
    assert (new.slot, new.request_id, new.token_ids.tolist(), new.num_prompt_tokens, new.block_ids,
            new.num_computed_tokens, new.num_scheduled_tokens) == (1, "a", [5, 6, 7], 3, [10], 1, 2)
    assert (new.sampling.temperature, new.sampling.seed, new.sampling.logprobs, new.sampling.stop_token_ids) == (
        0.5, 9, 2, [3])
    assert (resumed.token_ids.tolist(), resumed.num_prompt_tokens, resumed.block_ids) == ([1, 2, 3, 4], 2, [11, 12])
    assert resumed.sampling.logprobs is None  # unset stays unset
    c = p.cached
    assert [a.tolist() for a in (c.slots, c.num_scheduled_tokens, c.num_new_blocks, c.new_block_ids,
                                 c.num_draft_slots)] == [[0, 3], [1, 1], [0, 1], [13], [2, 0]]
    assert p.replaced_tables == [(3, [14, 15])]
    assert (p.copy_src.tolist(), p.copy_dst.tolist(), p.prompt_lookup_min, p.prompt_lookup_max) == ([14], [16], 1, 3)


def test_an_output_packs_into_a_result():
    out = StepOutput(step_id=7, previous_step_id=6, num_scheduled_tokens=9, slots=np.array([1, 3, 3]),
                     token_ids=np.array([5, 6, 7]), finish_reasons=np.array([0, 0, step_output.FINISH_EOS]),
                     logprobs=Logprobs(np.array([2]), np.array([-0.5], np.float32), np.array([1]), np.array([7]),
                                       np.array([-0.5], np.float32)),
                     spec_slots=np.array([3]), spec_num_draft_tokens=np.array([2]),
                     spec_num_accepted_tokens=np.array([1]), num_constrained=1, forward_seconds=0.25)
    r = step_result(out)
    assert (r.step_id, r.previous_step_id, r.num_scheduled_tokens, list(r.slots), list(r.token_ids),
            list(r.finish_reasons)) == (7, 6, 9, [1, 3, 3], [5, 6, 7], [0, 0, pb.FINISH_REASON_EOS])
    assert (list(r.logprob_indices), list(r.logprobs), list(r.num_top_logprobs), list(r.top_logprob_token_ids),
            list(r.top_logprobs)) == ([2], [-0.5], [1], [7], [-0.5])
    assert (list(r.spec_slots), list(r.spec_num_draft_tokens), list(r.spec_num_accepted_tokens)) == ([3], [2], [1])
    assert (r.num_constrained, r.forward_seconds) == (1, 0.25)
    running = step_result(StepOutput(8, 7, slots=np.array([1]), token_ids=np.array([5]), finish_reasons=np.zeros(1)))
    assert not running.finish_reasons, "no finish: the reasons stay empty on the wire"


@pytest.mark.parametrize(("error", "code", "reason"), [
    (errors.InvalidPlan("x"), grpc.StatusCode.INVALID_ARGUMENT, plan_errors.INVALID),
    (errors.FencedPlan("x"), grpc.StatusCode.FAILED_PRECONDITION, plan_errors.FENCED),
    (errors.StaleStep("x"), grpc.StatusCode.FAILED_PRECONDITION, plan_errors.STALE_STEP),
    (errors.EpochMismatch("x"), grpc.StatusCode.FAILED_PRECONDITION, plan_errors.EPOCH_MISMATCH),
    (errors.PredecessorRefused("x"), grpc.StatusCode.FAILED_PRECONDITION, plan_errors.PREDECESSOR_REFUSED),
])
def test_each_refusal_maps_to_its_status_and_reason(error, code, reason):
    assert plan_error_code(error) == code
    assert plan_error_metadata(error) == ((plan_errors.REASON_KEY, reason),)


def test_a_refusal_names_the_entry_at_fault():
    e = errors.InvalidPlan("bad", request_id="r1", slot=4)
    assert plan_error_metadata(e) == ((plan_errors.REASON_KEY, plan_errors.INVALID), (plan_errors.SLOT_KEY, "4"),
                                      (plan_errors.REQUEST_ID_KEY, "r1"))
