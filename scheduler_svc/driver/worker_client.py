"""The scheduler's side of the worker protocol (llmserve.worker.v2): the channel, plans out, results in, typed errors.

The core's plain `SchedulerOutput` becomes a delta `StepPlan` here (a request the worker holds is sent as its slot,
new blocks and token count only, in packed arrays) and the wire `StepResult` becomes a plain `WorkerOutput`; the
slot table that maps request ids to the worker's slots lives here (`slot_table.py`). A refused plan is told apart
by the worker's trailing metadata (`common.plan_errors`), never by its message text. A worker that speaks another
protocol version has no service for our calls (UNIMPLEMENTED): that is a configuration error, not a lost worker.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from common import plan_errors, tls, tracing
from common.auth import with_worker_token
from common.config import MAX_MESSAGE_BYTES
from common.sampling_fields import SamplingParams
from common.sampling_wire import record_to_wire
from common.speculative_config import SpeculativeConfig
from common.validation import ConfigError
from common.worker_protocol import MAX_SLOTS, PACKAGE, SERVICE
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from scheduler_svc.core import prompt_results
from scheduler_svc.core.slot_table import SlotTable
from scheduler_svc.core.step_records import (
    WORKER_EOS,
    WORKER_MAX_TOKENS,
    WORKER_STOP_TOKEN,
    Logprobs,
    SampledToken,
    SchedulerOutput,
    SpecStats,
    WorkerOutput,
)

_FINISH = {wpb.FINISH_REASON_EOS: WORKER_EOS, wpb.FINISH_REASON_STOP_TOKEN: WORKER_STOP_TOKEN,
           wpb.FINISH_REASON_MAX_TOKENS: WORKER_MAX_TOKENS}
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def sampling_to_wire(s: SamplingParams) -> wpb.SamplingParams:
    """Every field explicitly (by the table's names); the proto's optional seed and logprobs only when set (unset:
    the worker draws a seed, returns no logprobs)."""
    return record_to_wire(s, wpb.SamplingParams())


class WorkerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class WorkerFenced(WorkerError):
    """The worker has seen a newer fencing token: another scheduler leads this pool now."""


class PlanRejected(WorkerError):
    """The worker refused the whole plan (nothing of it ran). `request_id` names the request at fault, if one is."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str):
        super().__init__(code, message)
        self.request_id = request_id


class WorkerLost(WorkerError):
    """The call failed (unreachable, restarted, timed out, stale step or epoch): what the worker did is unknown."""


class StaleStep(WorkerLost):
    """The worker already ran a step with this id or a newer one: another scheduler drove it since we read its
    state (two schedulers racing for the pool after a fail-over or a kill; the loser retries)."""


def _typed_error(err: grpc.RpcError, owners: list[str | None] | None = None) -> WorkerError:
    """`owners`: the slot table as the plan saw it, to name the request at fault by the slot the worker names."""
    trailing = dict(err.trailing_metadata() or ())
    reason, code, message = trailing.get(plan_errors.REASON_KEY), err.code(), err.details() or ""
    if reason == plan_errors.FENCED:
        return WorkerFenced(code, message)
    if reason == plan_errors.INVALID and code == grpc.StatusCode.INVALID_ARGUMENT:
        request_id = trailing.get(plan_errors.REQUEST_ID_KEY, "")
        slot = trailing.get(plan_errors.SLOT_KEY, "")
        if not request_id and owners and slot.isdigit() and int(slot) < len(owners):
            request_id = owners[int(slot)] or ""
        return PlanRejected(code, message, request_id)
    if reason == plan_errors.STALE_STEP:
        return StaleStep(code, message)
    return WorkerLost(code, message)


class WorkerClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None, token: str | None = None, step_timeout: float = 600.0):
        self.address = address
        self.tls = credentials is not None
        self.step_timeout = step_timeout
        self._open = lambda: tls.open_channel(address, credentials, server_name, options=_CHANNEL_OPTIONS)
        self._token = token
        self.channel = None
        self.reopen()
        self.info: wpb.WorkerInfo | None = None  # the last Describe
        self.previous_epoch: str | None = None  # the epoch the pool's registry had before `info`
        self.slots = SlotTable(MAX_SLOTS)  # which request holds which slot of the worker's batch

    def reopen(self) -> None:
        """A fresh channel: a restarted worker is reached at once, not after the old channel's reconnect backoff."""
        if self.channel is not None:
            self.channel.close()
        self.channel = self._open()
        self.stub = wpb_grpc.WorkerStub(with_worker_token(self.channel, self._token))

    def describe(self, timeout: float = 5.0) -> wpb.WorkerInfo:
        try:
            return self.stub.Describe(wpb.DescribeRequest(), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ConfigError(
                    f"the worker at {self.address} does not serve {SERVICE} ({e.code().name}: {e.details()}): it "
                    f"speaks another version of the worker protocol than this scheduler ({PACKAGE}); run the same "
                    "llmserve version on both") from None
            raise _typed_error(e) from None

    def connect_hint(self, err: WorkerError) -> str:
        """Why a connection attempt failed, for the log (TLS handshake failures hide in the details)."""
        return f"{err.code.name}: {err}{tls.closed_hint(str(err), self.tls)}"

    def prepare_constraint(self, kind: str, spec: str, disable_any_whitespace: bool = False,
                           timeout: float = 300.0) -> wpb.PrepareConstraintReply:
        """Have the worker compile a structured-output constraint into its cache (off its step loop). A constraint
        that does not compile raises WorkerError with INVALID_ARGUMENT and xgrammar's reason."""
        try:
            return self.stub.PrepareConstraint(wpb.Constraint(kind=kind, spec=spec,
                                                              disable_any_whitespace=disable_any_whitespace),
                                               timeout=timeout)
        except grpc.RpcError as e:
            raise WorkerError(e.code(), e.details() or "") from None

    def fence(self, step_id: int, token: int) -> int:
        """Reset the worker's batch under our fencing token; returns the last step id it executed before."""
        plan = wpb.StepPlan(step_id=step_id, fencing_token=token, expected_epoch=self.info.epoch, reset_batch=True)
        self.slots.clear()
        return self._call(plan, 30, None)().previous_step_id

    def execute(self, plan: wpb.StepPlan, trace_parent=None) -> WorkerOutput:
        return self.send(plan, trace_parent)()

    def send(self, plan: wpb.StepPlan, trace_parent=None) -> Callable[..., WorkerOutput]:
        """Send the plan now; the returned function (optional `timeout`) waits for the step's result while the
        caller works meanwhile."""
        owners = self.slots.snapshot()
        return self._call(plan, self.step_timeout, trace_parent, lambda r: self._decode(r, owners), owners)

    def _decode(self, result: wpb.StepResult, owners: list[str | None]) -> WorkerOutput:
        output = decode_result(result, owners)
        for tok, slot in zip(output.tokens, result.slots, strict=True):
            if tok.finish:  # the worker forgot the request: its slot is free for the next plan to give away
                self.slots.finished(slot, tok.request_id)
        return output

    def _call(self, plan: wpb.StepPlan, timeout: float, trace_parent, decode=lambda r: r, owners=None):
        span = None
        metadata = None
        if trace_parent is not None:
            from opentelemetry.trace import SpanKind

            span = tracing.tracer.start_span(
                "llmserve.worker/ExecuteStep", context=tracing.context_with(trace_parent), kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": SERVICE,
                            "rpc.method": "ExecuteStep", "llmserve.step.id": plan.step_id})
            metadata = tracing.inject(span)
        future = self.stub.ExecuteStep.future(plan, timeout=timeout, metadata=metadata)

        def wait(timeout: float | None = None):
            try:
                result = future.result(timeout=timeout)
            except grpc.FutureTimeoutError:
                self.slots.stale = True
                raise WorkerLost(grpc.StatusCode.DEADLINE_EXCEEDED, f"no result within {timeout} s") from None
            except grpc.RpcError as e:
                self.slots.stale = True
                if span is not None:
                    span.set_attribute("rpc.grpc.status_code", e.code().value[0])
                raise _typed_error(e, owners) from None
            finally:
                if span is not None:
                    span.end()
            if span is not None:
                trace_parent.set_attributes({"llmserve.worker.prepare_seconds": result.prepare_seconds,
                                             "llmserve.worker.forward_seconds": result.forward_seconds,
                                             "llmserve.worker.sample_seconds": result.sample_seconds})
            return decode(result)

        return wait


def decode_result(result: wpb.StepResult, owners: list[str | None]) -> WorkerOutput:
    """The packed result as plain tokens; `owners` is the slot table as the step's plan saw it."""
    rids = [owners[s] for s in result.slots]
    finish = [_FINISH.get(r) for r in result.finish_reasons] if result.finish_reasons else [None] * len(rids)
    tokens = [SampledToken(rid, tok, fin) for rid, tok, fin in zip(rids, result.token_ids, finish, strict=True)]
    top_ids, top_lps, at = result.top_logprob_token_ids, result.top_logprobs, 0
    for i, lp, n in zip(result.logprob_indices, result.logprobs, result.num_top_logprobs, strict=True):
        tokens[i].logprobs = Logprobs(lp, list(zip(top_ids[at: at + n], top_lps[at: at + n], strict=True)))
        at += n
    output = WorkerOutput(tokens, result.prepare_seconds, result.forward_seconds, result.sample_seconds,
                          result.idle_seconds, result.num_constrained, result.mask_seconds)
    if result.spec_slots:
        output.spec = spec_stats(result.spec_num_draft_tokens, result.spec_num_accepted_tokens)
    if result.prompt_lp_slots:
        output.prompt_scores = prompt_results.decode(
            result.prompt_lp_slots, result.prompt_lp_starts, result.prompt_lp_counts, result.prompt_lp_num_top,
            result.prompt_lp_values, result.prompt_lp_top_token_ids, result.prompt_lp_top_values, owners)
    if result.pooled_slots:
        dim = result.embedding_dim
        output.embeddings = {owners[s]: list(result.pooled[i * dim: (i + 1) * dim])
                             for i, s in enumerate(result.pooled_slots)}
    return output


def spec_stats(num_draft_tokens, num_accepted_tokens) -> SpecStats:
    """Totals and per-position acceptance of one step's verified drafts (one entry per request)."""
    drafts, accepted = list(num_draft_tokens), list(num_accepted_tokens)
    per_pos = [0] * max(drafts, default=0)
    for a in accepted:  # a handful of requests, a few positions each
        for j in range(a):
            per_pos[j] += 1
    return SpecStats(num_drafts=len(drafts), num_draft_tokens=sum(drafts), num_accepted_tokens=sum(accepted),
                     accepted_per_pos=per_pos)


def encode_plan(out: SchedulerOutput, slots: SlotTable, *, step_id: int, token: int, epoch: str, reset: bool,
                dropped: list[str], after_step_id: int = 0,
                speculative: SpeculativeConfig | None = None) -> wpb.StepPlan:
    """The step as a delta plan. Frees the dropped requests' slots, gives joining requests one, and marks every
    scheduled request as held by the worker from now on."""
    if reset:
        slots.clear()
    elif slots.stale:
        raise RuntimeError("a plan after a failed step must reset the worker's batch: its slots are unknown")
    plan = wpb.StepPlan(step_id=step_id, fencing_token=token, expected_epoch=epoch, reset_batch=reset,
                        after_step_id=after_step_id)
    plan.dropped_slots.extend(s for s in map(slots.leave, dropped) if s is not None)
    plan.copy_blocks.extend(wpb.BlockCopy(src=src, dst=dst) for src, dst in out.copies)
    for src, dst in out.state_copies:
        plan.state_copy_src.append(src)
        plan.state_copy_dst.append(dst)
    for save in out.state_saves:
        plan.state_save_src.append(save.src)
        plan.state_save_dst.append(save.slot)
    cached_slots: list[int] = []
    scheduled: list[int] = []
    counts: list[int] = []
    new_blocks: list[int] = []
    draft_slots: list[int] = []
    for req in out.scheduled:
        rid, n = req.request_id, out.num_tokens[req.request_id]
        if req.on_worker:
            slot = slots.slot_of[rid]
            cached_slots.append(slot)
            scheduled.append(n)
            draft_slots.append(out.num_draft_slots.get(rid, 0))
            if rid in out.replaced_tables:
                plan.replaced_tables.add(slot=slot, block_ids=req.block_ids)
                counts.append(0)
            else:
                blocks = out.new_blocks[rid]
                counts.append(len(blocks))
                new_blocks += blocks
        elif req.output_ids:
            entry = plan.resumed_requests.add(
                slot=slots.join(rid), request_id=rid, token_ids=req.all_token_ids,
                num_prompt_tokens=req.num_prompt_tokens, sampling=sampling_to_wire(req.sampling),
                block_ids=req.block_ids, num_computed_tokens=out.num_computed_before[rid], num_scheduled_tokens=n,
                lora_name=req.lora_name, lora_path=req.lora_path)
        else:
            entry = plan.new_requests.add(
                slot=slots.join(rid), request_id=rid, prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_wire(req.sampling), block_ids=req.block_ids,
                num_computed_tokens=out.num_computed_before[rid], num_scheduled_tokens=n,
                lora_name=req.lora_name, lora_path=req.lora_path)
        if not req.on_worker and req.state_slot >= 0:
            entry.state_slot = req.state_slot
        req.on_worker = True
    cached = plan.cached
    cached.slots.extend(cached_slots)
    cached.num_scheduled_tokens.extend(scheduled)
    if new_blocks:  # most decode steps allocate none: the counts are then left out
        cached.num_new_blocks.extend(counts)
        cached.new_block_ids.extend(new_blocks)
    if out.num_draft_slots and speculative is not None:
        cached.num_draft_slots.extend(draft_slots)
        plan.prompt_lookup_min = speculative.prompt_lookup_min
        plan.prompt_lookup_max = speculative.prompt_lookup_max
    return plan
