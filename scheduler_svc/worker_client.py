"""The scheduler's side of the worker protocol (llmserve.worker.v1): the channel, plans out, results in, typed errors.

The core's plain `SchedulerOutput` becomes a delta `StepPlan` here (a request the worker holds is sent as its new
blocks and token count only) and the wire `StepResult` becomes a plain `WorkerOutput`. A refused plan is told apart
by the worker's trailing metadata (`common.plan_errors`), never by its message text.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from common import plan_errors, tls, tracing
from common.auth import with_worker_token
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from scheduler_svc.outputs import (
    WORKER_EOS,
    WORKER_MAX_TOKENS,
    WORKER_STOP_TOKEN,
    Logprobs,
    SampledToken,
    SchedulerOutput,
    WorkerOutput,
)
from scheduler_svc.worker_wire import sampling_to_wire

_FINISH = {wpb.FINISH_REASON_EOS: WORKER_EOS, wpb.FINISH_REASON_STOP_TOKEN: WORKER_STOP_TOKEN,
           wpb.FINISH_REASON_MAX_TOKENS: WORKER_MAX_TOKENS}
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


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


def _typed_error(err: grpc.RpcError) -> WorkerError:
    trailing = dict(err.trailing_metadata() or ())
    reason, code, message = trailing.get(plan_errors.REASON_KEY), err.code(), err.details() or ""
    if reason == plan_errors.FENCED:
        return WorkerFenced(code, message)
    if reason == plan_errors.INVALID and code == grpc.StatusCode.INVALID_ARGUMENT:
        return PlanRejected(code, message, trailing.get(plan_errors.REQUEST_ID_KEY, ""))
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
            raise _typed_error(e) from None

    def connect_hint(self, err: WorkerError) -> str:
        """Why a connection attempt failed, for the log (TLS handshake failures hide in the details)."""
        return f"{err.code.name}: {err}{tls.closed_hint(str(err), self.tls)}"

    def fence(self, step_id: int, token: int) -> int:
        """Reset the worker's batch under our fencing token; returns the last step id it executed before."""
        plan = wpb.StepPlan(step_id=step_id, fencing_token=token, expected_epoch=self.info.epoch, reset_batch=True)
        return self._call(plan, 30, None)().previous_step_id

    def execute(self, plan: wpb.StepPlan, trace_parent=None) -> WorkerOutput:
        return self.send(plan, trace_parent)()

    def send(self, plan: wpb.StepPlan, trace_parent=None) -> Callable[..., WorkerOutput]:
        """Send the plan now; the returned function (optional `timeout`) waits for the step's result while the
        caller works meanwhile."""
        return self._call(plan, self.step_timeout, trace_parent, _decode)

    def _call(self, plan: wpb.StepPlan, timeout: float, trace_parent, decode=lambda r: r):
        span = None
        metadata = None
        if trace_parent is not None:
            from opentelemetry.trace import SpanKind

            span = tracing.tracer.start_span(
                "llmserve.worker/ExecuteStep", context=tracing.context_with(trace_parent), kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": "llmserve.worker.v1.Worker",
                            "rpc.method": "ExecuteStep", "llmserve.step.id": plan.step_id})
            metadata = tracing.inject(span)
        future = self.stub.ExecuteStep.future(plan, timeout=timeout, metadata=metadata)

        def wait(timeout: float | None = None):
            try:
                result = future.result(timeout=timeout)
            except grpc.FutureTimeoutError:
                raise WorkerLost(grpc.StatusCode.DEADLINE_EXCEEDED, f"no result within {timeout} s") from None
            except grpc.RpcError as e:
                if span is not None:
                    span.set_attribute("rpc.grpc.status_code", e.code().value[0])
                raise _typed_error(e) from None
            finally:
                if span is not None:
                    span.end()
            if span is not None:
                trace_parent.set_attributes({"llmserve.worker.prepare_seconds": result.prepare_seconds,
                                             "llmserve.worker.forward_seconds": result.forward_seconds,
                                             "llmserve.worker.sample_seconds": result.sample_seconds})
            return decode(result)

        return wait


def _decode(result: wpb.StepResult) -> WorkerOutput:
    tokens = [SampledToken(t.request_id, t.token_id, _FINISH.get(t.finish_reason),
                           Logprobs(t.logprob, [(x.token_id, x.logprob) for x in t.top_logprobs])
                           if t.HasField("logprob") else None)
              for t in result.tokens]
    return WorkerOutput(tokens, result.prepare_seconds, result.forward_seconds, result.sample_seconds,
                        result.idle_seconds)


def encode_plan(out: SchedulerOutput, *, step_id: int, token: int, epoch: str, reset: bool,
                dropped: list[str], after_step_id: int = 0) -> wpb.StepPlan:
    """The step as a delta plan. Marks every scheduled request as held by the worker from now on."""
    plan = wpb.StepPlan(step_id=step_id, fencing_token=token, expected_epoch=epoch, reset_batch=reset,
                        dropped_request_ids=dropped, after_step_id=after_step_id)
    plan.copy_blocks.extend(wpb.BlockCopy(src=src, dst=dst) for src, dst in out.copies)
    for req in out.scheduled:
        rid, n = req.request_id, out.num_tokens[req.request_id]
        if req.on_worker and rid in out.replaced_tables:
            plan.cached_requests.add(request_id=rid, block_table=req.block_ids, num_scheduled_tokens=n)
        elif req.on_worker:
            plan.cached_requests.add(request_id=rid, new_block_ids=out.new_blocks[rid], num_scheduled_tokens=n)
        elif req.output_ids:
            plan.resumed_requests.add(
                request_id=rid, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                sampling=sampling_to_wire(req.sampling), block_ids=req.block_ids,
                num_computed_tokens=out.num_computed_before[rid], num_scheduled_tokens=n)
        else:
            plan.new_requests.add(
                request_id=rid, prompt_token_ids=req.prompt_ids, sampling=sampling_to_wire(req.sampling),
                block_ids=req.block_ids, num_computed_tokens=out.num_computed_before[rid], num_scheduled_tokens=n)
        req.on_worker = True
    return plan
