"""The worker's persistent batch: the plan protocol over the request rows of an InputBatch.

`check_plan` validates a whole plan against the current state without touching it, so a bad
plan changes nothing; `apply_plan` then mutates. Both walk the plan in the same order.

Steady state is mostly cached requests (decodes), so those are checked together with array
operations; only a plan that fails that check is walked request by request, to name the first
offender with the message it always had. `requests` and the chunks a Schedule yields are views
of the rows (worker_svc/request_views.py) for code that wants one request at a time (tests,
tools); the step itself never builds them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from common import plan_errors
from protos import worker_pb2 as pb
from worker_svc.input_batch import InputBatch
from worker_svc.request_views import Requests, RequestState, ScheduledChunk
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
class BatchLimits:
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


@dataclass
class Schedule:
    """The step's chunks in plan order, as arrays: row rows[i] computes its tokens [starts[i], starts[i] + lengths[i]).

    Iterating yields ScheduledChunk views, for code that handles one request at a time.
    """

    inputs: InputBatch
    rows: np.ndarray  # int64
    starts: np.ndarray  # int64: the row's num_computed_tokens when the plan was applied
    lengths: np.ndarray  # int64, > 0

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ScheduledChunk]:
        for row, start, length in zip(self.rows.tolist(), self.starts.tolist(), self.lengths.tolist(), strict=True):
            yield ScheduledChunk(RequestState(self.inputs, row), start, length)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class CachedDeltas:
    """A plan's cached requests as arrays, parsed once: check_plan returns them for apply_plan."""

    request_ids: list[str]
    rows: np.ndarray  # int64; -1 where the request is not live
    scheduled: np.ndarray  # int64
    # The entries with block changes (few but for steps that cross a block boundary): their index, their new
    # block table if they have one, and their new blocks, flat, with how many each.
    changed: np.ndarray  # int64
    tables: dict[int, list[int]]  # entry index -> replacement block table
    new_blocks: np.ndarray  # int64
    new_counts: np.ndarray  # int64, per changed entry

    @staticmethod
    def parse(plan: pb.StepPlan, row_of: Mapping[str, int]) -> CachedDeltas:
        # One pass over the messages (each field access costs a fraction of a microsecond), then C-level maps.
        entries = [(r.request_id, r.num_scheduled_tokens, r.new_block_ids, r.block_table) for r in plan.cached_requests]
        rids, scheduled, news, tables = zip(*entries, strict=True) if entries else ((), (), (), ())
        n = len(rids)
        has_blocks = np.fromiter(map(len, news), np.int64, n) + np.fromiter(map(len, tables), np.int64, n)
        changed = np.flatnonzero(has_blocks).tolist()
        return CachedDeltas(
            request_ids=list(rids),
            rows=np.fromiter(map(row_of.get, rids, itertools.repeat(-1)), np.int64, n),
            scheduled=np.array(scheduled, dtype=np.int64),
            changed=np.array(changed, dtype=np.int64),
            tables={i: list(tables[i]) for i in changed if tables[i]},
            new_blocks=np.fromiter(itertools.chain.from_iterable(news[i] for i in changed), dtype=np.int64),
            new_counts=np.array([len(news[i]) for i in changed], dtype=np.int64),
        )


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
        self.inputs = InputBatch(limits.max_model_len)
        self.requests = Requests(self.inputs)
        self.last_step_id = 0
        self.fencing_token = 0

    # -- validation (no mutation) -------------------------------------------------------------

    def check_plan(self, plan: pb.StepPlan, epoch: str) -> CachedDeltas:
        """Raise PlanError unless the whole plan is valid; return its parsed cached requests (for apply_plan)."""
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
        row_of = {} if plan.reset_batch else self.inputs.row_of
        dropped = set(plan.dropped_request_ids)
        seen: set[str] = set()

        def live(rid: str) -> bool:
            return rid in row_of and rid not in dropped

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
                if live(r.request_id):
                    raise _invalid(f"{where}: request_id {r.request_id!r} already exists on this worker")
                self._check_tokens(where, r.prompt_token_ids, len(r.prompt_token_ids))
                self._check_sampling(where, r.sampling)
                self._check_chunk(where, r.block_ids, len(r.prompt_token_ids), r.num_computed_tokens,
                                  r.num_scheduled_tokens)
        for r in plan.resumed_requests:
            with _blame(r.request_id):
                where = f"resumed_requests[{r.request_id!r}]"
                claim(r.request_id, where)
                self._check_tokens(where, r.token_ids, r.num_prompt_tokens)
                self._check_sampling(where, r.sampling)
                self._check_chunk(where, r.block_ids, len(r.token_ids), r.num_computed_tokens,
                                  r.num_scheduled_tokens)
        cached = CachedDeltas.parse(plan, row_of)
        if not self._cached_valid(cached, dropped, seen):
            self._check_each_cached(plan, live, claim)  # names the first offender
        n = self.limits.num_blocks
        for i, c in enumerate(plan.copy_blocks):
            if not (0 <= c.src < n and 0 <= c.dst < n) or c.src == c.dst:
                raise _invalid(f"copy_blocks[{i}]: src {c.src} and dst {c.dst} must be distinct blocks in [0, {n})")
        return cached

    def _cached_valid(self, d: CachedDeltas, dropped: set[str], seen: set[str]) -> bool:
        """Every check of `_check_each_cached` at once, with array operations: True when it would pass."""
        if not len(d.rows):
            return True
        inputs, n = self.inputs, self.limits.num_blocks
        if (d.rows < 0).any():
            return False
        once = np.zeros(inputs.num_rows, dtype=bool)
        once[d.rows] = True  # distinct live ids have distinct rows
        if once.sum() < len(d.rows):
            return False
        if (seen and not seen.isdisjoint(d.request_ids)) or (dropped and not dropped.isdisjoint(d.request_ids)):
            return False
        # The blocks a request already holds were checked when they came; new ones and replacement tables now.
        ids = np.concatenate([d.new_blocks, *(np.array(t, dtype=np.int64) for t in d.tables.values())])
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            return False
        blocks = inputs.num_blocks[d.rows]
        for i, table in d.tables.items():
            if len(table) < blocks[i]:
                return False
            blocks[i] = len(table)
        blocks[d.changed] += d.new_counts
        need = inputs.num_computed_tokens[d.rows] + d.scheduled
        return bool((need <= inputs.num_tokens[d.rows]).all() and (need <= blocks * self.limits.block_size).all())

    def _check_each_cached(self, plan: pb.StepPlan, live: Callable[[str], bool],
                           claim: Callable[[str, str], None]) -> None:
        inputs = self.inputs
        for r in plan.cached_requests:
            with _blame(r.request_id):
                where = f"cached_requests[{r.request_id!r}]"
                claim(r.request_id, where)
                if not live(r.request_id):
                    raise _invalid(f"{where}: unknown request_id {r.request_id!r} (not on this worker, or dropped)")
                row = inputs.row_of[r.request_id]
                held = inputs.block_table[row, : inputs.num_blocks[row]].tolist()
                table = list(r.block_table) if r.block_table else held
                if r.block_table and len(r.block_table) < len(held):
                    raise _invalid(f"{where}: block_table has {len(r.block_table)} blocks, fewer than the "
                                   f"{len(held)} the request holds")
                self._check_chunk(where, table + list(r.new_block_ids), int(inputs.num_tokens[row]),
                                  int(inputs.num_computed_tokens[row]), r.num_scheduled_tokens)

    def _check_tokens(self, where: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        if num_prompt_tokens < 1 or num_prompt_tokens > len(token_ids):
            raise _invalid(f"{where}: needs 1 <= num_prompt_tokens <= len(token_ids)={len(token_ids)}, "
                           f"got {num_prompt_tokens}")
        if len(token_ids) >= self.limits.max_model_len:
            raise _invalid(f"{where}: {len(token_ids)} tokens leave no room below max_model_len "
                           f"{self.limits.max_model_len}")
        vocab = self.limits.vocab_size
        ids = np.asarray(token_ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if len(bad):
            raise _invalid(f"{where}: token id {ids[bad[0]]} is outside the vocabulary [0, {vocab})")

    def _check_sampling(self, where: str, p: pb.SamplingParams) -> None:
        # The sampler indexes the logits with these; out of range they would fail mid-step, after mutation.
        vocab = self.limits.vocab_size
        bad = next((t for t in p.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(f"{where}: stop token id {bad} is outside the vocabulary [0, {vocab})")
        if p.HasField("logprobs") and p.logprobs > vocab:
            raise _invalid(f"{where}: logprobs {p.logprobs} exceeds the vocabulary size {vocab}")

    def _check_chunk(self, where: str, block_ids: Sequence[int], num_tokens: int, computed: int,
                     scheduled: int) -> None:
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

    def apply_plan(self, plan: pb.StepPlan, cached: CachedDeltas | None = None) -> Schedule:
        """Apply a checked plan (`cached`: what check_plan returned for it); return the step's chunks, in plan
        order."""
        self.last_step_id = plan.step_id
        self.fencing_token = plan.fencing_token
        inputs = self.inputs
        if cached is None:
            cached = CachedDeltas.parse(plan, {} if plan.reset_batch else inputs.row_of)
        if plan.reset_batch:
            inputs.clear()
        for rid in plan.dropped_request_ids:
            if rid in inputs.row_of:
                inputs.free(inputs.row_of[rid])
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []

        def join(rid: str, token_ids: Sequence[int], num_prompt_tokens: int, sampling: pb.SamplingParams,
                 block_ids: Sequence[int], computed: int, scheduled: int) -> None:
            if rid in inputs.row_of:  # a resumed request replaces what the worker had of it
                inputs.free(inputs.row_of[rid])
            row = inputs.add(rid, token_ids, num_prompt_tokens, SamplingParams.from_proto(sampling), block_ids,
                             computed)
            if scheduled > 0:
                rows.append(row)
                starts.append(computed)
                lengths.append(scheduled)

        for r in plan.new_requests:
            join(r.request_id, r.prompt_token_ids, len(r.prompt_token_ids), r.sampling, r.block_ids,
                 r.num_computed_tokens, r.num_scheduled_tokens)
        for r in plan.resumed_requests:
            join(r.request_id, r.token_ids, r.num_prompt_tokens, r.sampling, r.block_ids, r.num_computed_tokens,
                 r.num_scheduled_tokens)
        for i, table in cached.tables.items():
            inputs.set_blocks(int(cached.rows[i]), table)
        inputs.append_blocks(cached.rows[cached.changed], cached.new_counts, cached.new_blocks)
        on = cached.rows[cached.scheduled > 0]
        return Schedule(
            inputs,
            rows=np.concatenate([np.array(rows, dtype=np.int64), on]),
            starts=np.concatenate([np.array(starts, dtype=np.int64), inputs.num_computed_tokens[on]]),
            lengths=np.concatenate([np.array(lengths, dtype=np.int64), cached.scheduled[cached.scheduled > 0]]),
        )
