"""The worker's persistent batch: the plan protocol over the request rows of an InputBatch.

`check_plan` validates a whole plan against the current state without touching it, so a bad
plan changes nothing; `apply_plan` then mutates. Both walk the plan in the same order.

Requests are addressed by slot, and slot s lives in row s of the InputBatch, so the plan's
packed arrays index the batch's columns directly. Steady state is mostly cached requests
(decodes), so those are checked together with array operations; only a plan that fails that
check is walked entry by entry, to name the first offender. A refusal is a typed PlanError
(worker_svc/core/errors.py); the gRPC edge maps it to a status code.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.sampling_fields import SamplingParams
from common.structured_outputs import Constraint, ConstraintError
from common.worker_protocol import MAX_SLOTS
from worker_svc.core.errors import EpochMismatch, FencedPlan, InvalidPlan, PlanError, StaleStep
from worker_svc.core.input_batch import InputBatch
from worker_svc.core.plan import JoiningRequest, StepPlan
from worker_svc.core.state_plan import check_state_plan
from worker_svc.sampling.grammar import GrammarCache


@dataclass
class BatchLimits:
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    num_state_slots: int = 0  # hybrid models: the recurrent-state pool's slots (0: a model without one)


@dataclass
class Schedule:
    """The step's chunks in plan order, as arrays: row rows[i] computes tokens [starts[i], starts[i] + lengths[i])."""

    inputs: InputBatch
    rows: np.ndarray  # int64
    starts: np.ndarray  # int64: the row's num_computed_tokens when the plan was applied
    lengths: np.ndarray  # int64, > 0
    # Speculative decoding: draft positions row rows[i] may verify after its chunk (None: no entry has any).
    draft_slots: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass
class CachedDeltas:
    """A plan's cached requests as arrays, parsed once: check_plan returns them for apply_plan."""

    slots: np.ndarray  # int64: the rows
    scheduled: np.ndarray  # int64
    new_counts: np.ndarray  # int64, per entry (zeros when the plan sends none)
    new_blocks: np.ndarray  # int64, flat
    tables: dict[int, list[int]]  # entry index -> replacement block table
    # slot of a joining constrained request -> its grammar matcher (built by check_plan: compiling can fail)
    matchers: dict[int, object] = dataclasses.field(default_factory=dict)
    draft_slots: np.ndarray | None = None  # int64 per entry; None when the plan grants no draft positions

    @staticmethod
    def parse(plan: StepPlan) -> CachedDeltas:
        c = plan.cached
        slots = c.slots.astype(np.int64, copy=False)
        n = len(slots)
        if len(c.num_scheduled_tokens) != n:
            raise _invalid(f"cached: num_scheduled_tokens has {len(c.num_scheduled_tokens)} entries, slots {n}")
        if len(c.num_new_blocks) not in (0, n):
            raise _invalid(f"cached: num_new_blocks has {len(c.num_new_blocks)} entries, slots {n} (or none)")
        counts = c.num_new_blocks.astype(np.int64, copy=False) if len(c.num_new_blocks) else np.zeros(n, np.int64)
        if int(counts.sum()) != len(c.new_block_ids):
            raise _invalid(f"cached: num_new_blocks add up to {int(counts.sum())}, new_block_ids has "
                           f"{len(c.new_block_ids)}")
        if len(c.num_draft_slots) not in (0, n):
            raise _invalid(f"cached: num_draft_slots has {len(c.num_draft_slots)} entries, slots {n} (or none)")
        drafts = c.num_draft_slots.astype(np.int64, copy=False) if len(c.num_draft_slots) else None
        if drafts is not None and not 1 <= plan.prompt_lookup_min <= plan.prompt_lookup_max:
            raise _invalid(f"num_draft_slots needs 1 <= prompt_lookup_min ({plan.prompt_lookup_min}) <= "
                           f"prompt_lookup_max ({plan.prompt_lookup_max})")
        tables: dict[int, list[int]] = {}
        for slot, block_ids in plan.replaced_tables:
            where = np.flatnonzero(slots == slot)
            if not len(where):
                raise _invalid(f"replaced_tables[slot {slot}]: the slot is not among the cached requests")
            if int(where[0]) in tables:
                raise _invalid(f"replaced_tables[slot {slot}]: the slot appears more than once")
            tables[int(where[0])] = list(block_ids)
        return CachedDeltas(slots=slots, scheduled=c.num_scheduled_tokens.astype(np.int64, copy=False),
                            new_counts=counts, new_blocks=c.new_block_ids.astype(np.int64, copy=False),
                            tables=tables, draft_slots=drafts)


def _invalid(msg: str) -> InvalidPlan:
    return InvalidPlan(msg)


@contextlib.contextmanager
def _blame(slot: int, request_id: str):
    """A PlanError raised while checking one request's entry names that request."""
    try:
        yield
    except PlanError as e:
        e.request_id = e.request_id or request_id
        e.slot = slot if e.slot is None else e.slot
        raise


class PersistentBatch:
    def __init__(self, limits: BatchLimits, grammars: GrammarCache | None = None):
        self.limits = limits
        self.grammars = grammars  # None: structured outputs are refused
        self.inputs = InputBatch(limits.max_model_len)
        self.last_step_id = 0
        self.fencing_token = 0

    # -- validation (no mutation) -------------------------------------------------------------

    def check_plan(self, plan: StepPlan, epoch: str) -> CachedDeltas:
        """Raise PlanError unless the whole plan is valid; return its parsed cached requests (for apply_plan)."""
        if plan.fencing_token < self.fencing_token:
            raise FencedPlan(f"fencing_token {plan.fencing_token} is older than {self.fencing_token}: "
                             "the plan comes from a scheduler that lost its lease")
        if plan.step_id <= self.last_step_id:
            raise StaleStep(f"step_id {plan.step_id} is not newer than the last executed step {self.last_step_id}")
        if plan.expected_epoch and plan.expected_epoch != epoch:
            raise EpochMismatch(f"expected_epoch {plan.expected_epoch!r} does not match this worker's epoch "
                                f"{epoch!r}: its KV cache was lost, resume the requests")
        inputs = self.inputs
        # Which rows hold a request once the plan's reset and drops are applied.
        live = np.zeros(inputs.num_rows, dtype=bool) if plan.reset_batch else inputs.live.copy()
        dropped = np.asarray(plan.dropped_slots, dtype=np.int64)
        live[dropped[dropped < len(live)]] = False
        joining: set[int] = set()  # slots of new and resumed entries
        matchers: dict[int, object] = {}

        def join(slot: int, rid: str, where: str) -> None:
            if slot >= MAX_SLOTS:
                raise _invalid(f"{where}: slot {slot} is not below {MAX_SLOTS}")
            if slot in joining:
                raise _invalid(f"{where}: slot {slot} joins more than once in the plan")
            if slot < len(live) and live[slot]:
                raise _invalid(f"{where}: slot {slot} still holds request {inputs.request_ids[slot]!r} "
                               "(drop it first)")
            if not rid:
                raise _invalid(f"{where}: request_id is empty")
            other = inputs.row_of.get(rid)
            if other is not None and live[other]:
                raise _invalid(f"{where}: request_id {rid!r} is already on this worker in slot {other}")
            joining.add(slot)

        for kind, entries in (("new_requests", plan.new_requests), ("resumed_requests", plan.resumed_requests)):
            for r in entries:
                with _blame(r.slot, r.request_id):
                    where = f"{kind}[slot {r.slot}, {r.request_id!r}]"
                    join(r.slot, r.request_id, where)
                    self._check_tokens(where, r.token_ids, r.num_prompt_tokens)
                    self._check_sampling(where, r.sampling)
                    self._check_chunk(where, r.block_ids, len(r.token_ids), r.num_computed_tokens,
                                      r.num_scheduled_tokens)
                    self._check_constraint(where, r, matchers)
        cached = CachedDeltas.parse(plan)
        cached.matchers = matchers
        if not self._cached_valid(cached, live, joining):
            self._check_each_cached(cached, live, joining)  # names the first offender
        n = self.limits.num_blocks
        for i, (src, dst) in enumerate(zip(plan.copy_src.tolist(), plan.copy_dst.tolist(), strict=True)):
            if not (0 <= src < n and 0 <= dst < n) or src == dst:
                raise _invalid(f"copy_blocks[{i}]: src {src} and dst {dst} must be distinct blocks in [0, {n})")
        check_state_plan(plan, self.limits.num_state_slots, inputs.state_slot[live])
        return cached

    def _cached_valid(self, d: CachedDeltas, live: np.ndarray, joining: set[int]) -> bool:
        """Every check of `_check_each_cached` at once, with array operations: True when it would pass."""
        if not len(d.slots):
            return True
        inputs, n = self.inputs, self.limits.num_blocks
        if d.slots.min() < 0 or d.slots.max() >= len(live) or not live[d.slots].all():
            return False
        once = np.zeros(len(live), dtype=bool)
        once[d.slots] = True
        if once.sum() < len(d.slots):
            return False
        if joining and np.isin(d.slots, list(joining)).any():
            return False
        # The blocks a request already holds were checked when they came; new ones and replacement tables now.
        ids = np.concatenate([d.new_blocks, *(np.array(t, dtype=np.int64) for t in d.tables.values())])
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            return False
        blocks = inputs.num_blocks[d.slots]
        for i, table in d.tables.items():
            if len(table) < blocks[i]:
                return False
            blocks[i] = len(table)
        blocks += d.new_counts
        need = inputs.num_computed_tokens[d.slots] + d.scheduled
        return bool((need <= inputs.num_tokens[d.slots]).all() and (need <= blocks * self.limits.block_size).all())

    def _check_each_cached(self, d: CachedDeltas, live: np.ndarray, joining: set[int]) -> None:
        inputs = self.inputs
        seen: set[int] = set()
        ends = np.cumsum(d.new_counts)
        for i, slot in enumerate(d.slots.tolist()):
            known = 0 <= slot < len(live) and bool(live[slot])
            rid = inputs.request_ids[slot] if known else ""
            with _blame(slot, rid):
                where = f"cached[slot {slot}, {rid!r}]" if known else f"cached[slot {slot}]"
                if slot in seen or slot in joining:
                    raise _invalid(f"{where}: slot {slot} appears more than once in the plan")
                seen.add(slot)
                if not known:
                    raise _invalid(f"{where}: slot {slot} holds no request on this worker (never joined, or dropped)")
                held = inputs.block_table[slot, : inputs.num_blocks[slot]].tolist()
                table = d.tables.get(i, held)
                if len(table) < len(held):
                    raise _invalid(f"{where}: the replaced block table has {len(table)} blocks, fewer than the "
                                   f"{len(held)} the request holds")
                new = d.new_blocks[ends[i] - d.new_counts[i]: ends[i]].tolist()
                self._check_chunk(where, table + new, int(inputs.num_tokens[slot]),
                                  int(inputs.num_computed_tokens[slot]), int(d.scheduled[i]))

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

    def _check_sampling(self, where: str, p: SamplingParams) -> None:
        # The sampler indexes the logits with these; out of range they would fail mid-step, after mutation.
        vocab = self.limits.vocab_size
        bad = next((t for t in sorted(p.stop_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(f"{where}: stop token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in [*p.logit_bias, *(t for w in p.bad_words for t in w)] if not 0 <= t < vocab), None)
        if bad is not None:
            raise _invalid(f"{where}: logit_bias / bad_words token id {bad} is outside the vocabulary [0, {vocab})")
        if p.logprobs is not None and p.logprobs > vocab:
            raise _invalid(f"{where}: logprobs {p.logprobs} exceeds the vocabulary size {vocab}")

    def _check_constraint(self, where: str, r: JoiningRequest, matchers: dict[int, object]) -> None:
        """A joining constrained request's matcher, at the state after its output tokens (compiled now if the
        cache lacks the grammar)."""
        if r.sampling.constraint is None:
            return
        c = Constraint(**r.sampling.constraint)  # the record keeps it as a plain {kind, spec} dict (JSON in Redis)
        if self.grammars is None:
            raise _invalid(f"{where}: structured outputs (sampling.constraint) are not enabled on this worker")
        try:
            matchers[r.slot] = self.grammars.matcher(c, np.asarray(r.token_ids[r.num_prompt_tokens:], dtype=np.int64))
        except ConstraintError as e:
            raise _invalid(f"{where}: sampling.constraint ({c.kind}): {e}") from None

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

    def apply_plan(self, plan: StepPlan, cached: CachedDeltas | None = None) -> Schedule:
        """Apply a checked plan (`cached`: what check_plan returned for it); return the step's chunks, in plan
        order."""
        self.last_step_id = plan.step_id
        self.fencing_token = plan.fencing_token
        inputs = self.inputs
        if cached is None:
            cached = CachedDeltas.parse(plan)
        if plan.reset_batch:
            inputs.clear()
        for slot in np.asarray(plan.dropped_slots, dtype=np.int64).tolist():
            if slot < inputs.num_rows and inputs.live[slot]:
                inputs.free(slot)
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []

        for r in (*plan.new_requests, *plan.resumed_requests):
            matcher = cached.matchers.get(r.slot)
            if matcher is None and r.sampling.constraint is not None:  # applied without check_plan (tests)
                self._check_constraint("", r, cached.matchers)
                matcher = cached.matchers[r.slot]
            inputs.add(r.slot, r.request_id, r.token_ids, r.num_prompt_tokens, r.sampling, r.block_ids,
                       r.num_computed_tokens, matcher, r.state_slot)
            if r.num_scheduled_tokens > 0:
                rows.append(r.slot)
                starts.append(r.num_computed_tokens)
                lengths.append(r.num_scheduled_tokens)
        for i, table in cached.tables.items():
            inputs.set_blocks(int(cached.slots[i]), table)
        inputs.append_blocks(cached.slots, cached.new_counts, cached.new_blocks)
        on = cached.slots[cached.scheduled > 0]
        drafts = None
        if cached.draft_slots is not None:
            drafts = np.concatenate([np.zeros(len(rows), dtype=np.int64), cached.draft_slots[cached.scheduled > 0]])
        return Schedule(
            inputs,
            rows=np.concatenate([np.array(rows, dtype=np.int64), on]),
            starts=np.concatenate([np.array(starts, dtype=np.int64), inputs.num_computed_tokens[on]]),
            lengths=np.concatenate([np.array(lengths, dtype=np.int64), cached.scheduled[cached.scheduled > 0]]),
            draft_slots=drafts,
        )
