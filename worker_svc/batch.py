"""The worker's persistent batch: request state keyed by request id, updated by plan deltas.

`check_plan` validates a whole plan against the current state without touching it, so a bad
plan changes nothing; `apply_plan` then mutates. Both walk the plan in the same order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc

from common import plan_errors
from protos import worker_pb2 as pb
from worker_svc.sampling import SamplingParams


class PlanError(Exception):
    """A plan the worker refuses; carries the gRPC status it maps to, why, and the request at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = plan_errors.INVALID, request_id: str = ""):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.request_id = request_id

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        md = ((plan_errors.REASON_KEY, self.reason),)
        return md + ((plan_errors.REQUEST_ID_KEY, self.request_id),) if self.request_id else md


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute token_ids[start:start + length]."""

    state: RequestState
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.state.token_ids)


@dataclass
class BatchLimits:
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


def _invalid(msg: str) -> PlanError:
    return PlanError(grpc.StatusCode.INVALID_ARGUMENT, msg)


@contextlib.contextmanager
def _blame(request_id: str):
    """A PlanError raised while checking one request's entry names that request."""
    try:
        yield
    except PlanError as e:
        e.request_id = e.request_id or request_id
        raise


class PersistentBatch:
    def __init__(self, limits: BatchLimits):
        self.limits = limits
        self.requests: dict[str, RequestState] = {}
        self.last_step_id = 0
        self.fencing_token = 0

    # -- validation (no mutation) -------------------------------------------------------------

    def check_plan(self, plan: pb.StepPlan, epoch: str) -> None:
        if plan.fencing_token < self.fencing_token:
            raise PlanError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"fencing_token {plan.fencing_token} is older than {self.fencing_token}: "
                            "the plan comes from a scheduler that lost its lease", plan_errors.FENCED)
        if plan.step_id <= self.last_step_id:
            raise PlanError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"step_id {plan.step_id} is not newer than the last executed step {self.last_step_id}",
                            plan_errors.STALE_STEP)
        if plan.expected_epoch and plan.expected_epoch != epoch:
            raise PlanError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"expected_epoch {plan.expected_epoch!r} does not match this worker's epoch {epoch!r}: "
                            "its KV cache was lost, resume the requests", plan_errors.EPOCH_MISMATCH)
        live = set() if plan.reset_batch else set(self.requests) - set(plan.dropped_request_ids)
        seen: set[str] = set()

        def claim(rid: str, where: str) -> None:
            if not rid:
                raise _invalid(f"{where}: request_id is empty")
            if rid in seen:
                raise _invalid(f"{where}: request_id {rid!r} appears more than once in the plan")
            seen.add(rid)

        for r in plan.new_requests:
            with _blame(r.request_id):
                where = f"new_requests[{r.request_id!r}]"
                claim(r.request_id, where)
                if r.request_id in live:
                    raise _invalid(f"{where}: request_id {r.request_id!r} already exists on this worker")
                self._check_tokens(where, r.prompt_token_ids, len(r.prompt_token_ids))
                self._check_sampling(where, r.sampling)
                self._check_chunk(where, list(r.block_ids), len(r.prompt_token_ids), r.num_computed_tokens,
                                  r.num_scheduled_tokens)
        for r in plan.resumed_requests:
            with _blame(r.request_id):
                where = f"resumed_requests[{r.request_id!r}]"
                claim(r.request_id, where)
                self._check_tokens(where, r.token_ids, r.num_prompt_tokens)
                self._check_sampling(where, r.sampling)
                self._check_chunk(where, list(r.block_ids), len(r.token_ids), r.num_computed_tokens,
                                  r.num_scheduled_tokens)
        for r in plan.cached_requests:
            with _blame(r.request_id):
                where = f"cached_requests[{r.request_id!r}]"
                claim(r.request_id, where)
                if r.request_id not in live:
                    raise _invalid(f"{where}: unknown request_id {r.request_id!r} (not on this worker, or dropped)")
                s = self.requests[r.request_id]
                table = list(r.block_table) if r.block_table else s.block_ids
                if r.block_table and len(r.block_table) < len(s.block_ids):
                    raise _invalid(f"{where}: block_table has {len(r.block_table)} blocks, fewer than the "
                                   f"{len(s.block_ids)} the request holds")
                self._check_chunk(where, table + list(r.new_block_ids), len(s.token_ids), s.num_computed_tokens,
                                  r.num_scheduled_tokens)
        n = self.limits.num_blocks
        for i, c in enumerate(plan.copy_blocks):
            if not (0 <= c.src < n and 0 <= c.dst < n) or c.src == c.dst:
                raise _invalid(f"copy_blocks[{i}]: src {c.src} and dst {c.dst} must be distinct blocks in [0, {n})")

    def _check_tokens(self, where: str, token_ids, num_prompt_tokens: int) -> None:
        if num_prompt_tokens < 1 or num_prompt_tokens > len(token_ids):
            raise _invalid(f"{where}: needs 1 <= num_prompt_tokens <= len(token_ids)={len(token_ids)}, "
                           f"got {num_prompt_tokens}")
        if len(token_ids) >= self.limits.max_model_len:
            raise _invalid(f"{where}: {len(token_ids)} tokens leave no room below max_model_len "
                           f"{self.limits.max_model_len}")
        vocab = self.limits.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")

    def _check_sampling(self, where: str, p: pb.SamplingParams) -> None:
        # The sampler indexes the logits with these; out of range they would fail mid-step, after mutation.
        vocab = self.limits.vocab_size
        bad = next((t for t in p.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(f"{where}: stop token id {bad} is outside the vocabulary [0, {vocab})")
        if p.HasField("logprobs") and p.logprobs > vocab:
            raise _invalid(f"{where}: logprobs {p.logprobs} exceeds the vocabulary size {vocab}")

    def _check_chunk(self, where: str, block_ids: list[int], num_tokens: int, computed: int, scheduled: int) -> None:
        n = self.limits.num_blocks
        bad = next((b for b in block_ids if not 0 <= b < n), None)
        if bad is not None:
            raise _invalid(f"{where}: block id {bad} is out of range [0, {n})")
        if computed + scheduled > num_tokens:
            raise _invalid(f"{where}: num_computed_tokens {computed} + num_scheduled_tokens {scheduled} "
                           f"exceeds the {num_tokens} known tokens")
        size = self.limits.block_size
        if computed + scheduled > len(block_ids) * size:
            need = -(-(computed + scheduled) // size)
            raise _invalid(f"{where}: {computed + scheduled} tokens need {need} blocks of {size}, "
                           f"the block table has {len(block_ids)}")

    # -- mutation ---------------------------------------------------------------------------

    def apply_plan(self, plan: pb.StepPlan) -> list[ScheduledChunk]:
        """Apply a checked plan; return the chunks to compute this step, in plan order."""
        self.last_step_id = plan.step_id
        self.fencing_token = plan.fencing_token
        if plan.reset_batch:
            self.requests.clear()
        for rid in plan.dropped_request_ids:
            self.requests.pop(rid, None)
        chunks: list[ScheduledChunk] = []

        def schedule(state: RequestState, n: int) -> None:
            if n > 0:
                chunks.append(ScheduledChunk(state, state.num_computed_tokens, n))

        for r in plan.new_requests:
            s = RequestState(r.request_id, list(r.prompt_token_ids), len(r.prompt_token_ids),
                             SamplingParams.from_proto(r.sampling), list(r.block_ids), r.num_computed_tokens)
            self.requests[r.request_id] = s
            schedule(s, r.num_scheduled_tokens)
        for r in plan.resumed_requests:
            s = RequestState(r.request_id, list(r.token_ids), r.num_prompt_tokens,
                             SamplingParams.from_proto(r.sampling), list(r.block_ids), r.num_computed_tokens)
            self.requests[r.request_id] = s
            schedule(s, r.num_scheduled_tokens)
        for r in plan.cached_requests:
            s = self.requests[r.request_id]
            if r.block_table:
                s.block_ids = list(r.block_table)
            s.block_ids.extend(r.new_block_ids)
            schedule(s, r.num_scheduled_tokens)
        return chunks
