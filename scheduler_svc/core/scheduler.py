"""The scheduler core: every scheduling decision and every post-step change, as plain data in and out.

    core.add(requests)                       a request (its n sequences) joins the queue
    core.abort(request_id, reason)           ends a request early (client abort, stop string, worker rejection)
    out = core.schedule(now)                 queue timeouts, then the policy: who runs, how many tokens, which blocks
    outcome = core.update_from_output(out, worker_output, now)
                                             progress, sampled tokens, worker finishes, n > 1 forks, prefix-cache
                                             registration
    commit = core.take_commit(step_id)       everything that changed since the last commit, for one Redis write

No I/O: the driver owns threads, Redis, gRPC and observers and feeds this class plain data, so unit tests drive it
exactly as the driver does.
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.core import prompt_results
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig, prompt_snapshot_position, schedule
from scheduler_svc.core.prompt_results import skips_prefix_cache
from scheduler_svc.core.request import FINISH_LENGTH, FINISH_STOP, Request, Status
from scheduler_svc.core.state_pool import PendingSave, StateSlotPool
from scheduler_svc.core.step_records import (
    WORKER_EOS,
    WORKER_MAX_TOKENS,
    WORKER_STOP_TOKEN,
    SchedulerOutput,
    StepCommit,
    StepOutcome,
    WorkerOutput,
)

FINISH_TIMEOUT = "timeout"  # queue timeout: the stream ends with DEADLINE_EXCEEDED
FINISH_REJECTED = "rejected"  # the worker refused this request's plan entry: the stream ends with INVALID_ARGUMENT
_CLIENT_FINISH = {WORKER_EOS: FINISH_STOP, WORKER_STOP_TOKEN: FINISH_STOP, WORKER_MAX_TOKENS: FINISH_LENGTH}


def _accepted_drafts(out: SchedulerOutput, result: WorkerOutput) -> dict[str, int]:
    """request id -> drafts the worker accepted in this step: its tokens in the result minus the one every
    sampling step yields (a finish inside the run cuts it, but then the request is done anyway)."""
    counts: dict[str, int] = {}
    for tok in result.tokens:
        counts[tok.request_id] = counts.get(tok.request_id, 0) + 1
    return {rid: c - 1 for rid, c in counts.items() if c > 1 and rid in out.num_draft_slots}


class SchedulerCore:
    def __init__(self, policy: PolicyConfig, pool: BlockPool, queue_timeout: float = 0.0, arrival_seq: int = 0,
                 states: StateSlotPool | None = None):
        self.policy = policy
        self.pool = pool
        self.states = states  # hybrid models: the worker's state slots (None for a model without recurrent layers)
        self.queue_timeout = queue_timeout  # seconds a request may wait before its first step; 0 = forever
        self.arrival_seq = arrival_seq  # last arrival number handed out (persisted with each commit)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.forks: dict[str, list[Request]] = {}  # first sequence id -> siblings waiting for its prompt KV
        # What the next plan must tell the worker: forget these ids; or forget everything (reset_batch).
        self.to_drop: list[str] = []
        self.reset_worker = True
        # Changes since the last commit.
        self._new: list[Request] = []
        self._updated: list[Request] = []  # state changes made outside a step (requeues, forks, rejections)
        self._finished: list[Request] = []

    # ---- inputs -------------------------------------------------------------------------------------------------

    def add(self, seqs: list[Request]) -> None:
        """Queue the sequences of one request; with n > 1 the siblings fork from the first once its prompt is in."""
        first, *siblings = seqs
        for req in seqs:
            self.arrival_seq += 1
            req.arrival_seq = self.arrival_seq
            self.requests[req.request_id] = req
            self._new.append(req)
        self.waiting.append(first)
        if siblings:
            self.forks[first.request_id] = siblings

    def resume(self, requests: list[Request]) -> None:
        """Requests loaded from Redis by a new leader. The worker holds none of them: running ones requeue (to the
        front, in order) and recompute; their cached blocks make that cheap."""
        for req in requests:
            self.requests[req.request_id] = req
            if req.scheduled_time is None and (req.status == Status.RUNNING or req.output_ids or req.num_preemptions):
                # A previous leader already scheduled it: the queue timeout bounds only the wait for a first step.
                req.scheduled_time = req.arrival_time
            (self.running if req.status == Status.RUNNING else self.waiting).append(req)
        self.requeue_running()

    def abort(self, request_id: str, reason: str, error: str = "") -> Request | None:
        """End an unfinished request (client abort, stop string, rejection by the worker with `error`)."""
        req = self.requests.get(request_id)
        if req is not None:
            req.error = error
            self._finish(req, reason)
        return req

    def requeue_running(self) -> None:
        """Preempt every running request to the front of the queue, in order (the worker lost or forgot them).
        Tokens a lost step was sampling will not come: they are recomputed."""
        for req in self.requests.values():
            req.num_pending_tokens = 0
            req.num_draft_slots_in_flight = 0
        for req in reversed(self.running):
            self.pool.release(req.block_ids)
            req.block_ids = []
            self._release_state(req)
            req.num_computed_tokens = 0
            req.num_registered_blocks = 0
            req.status = Status.WAITING
            req.on_worker = False
            self.waiting.appendleft(req)
            self._updated.append(req)
        self.running.clear()

    def worker_lost(self) -> None:
        """Whatever the worker did with the last plan is unknown (a failed call, a new epoch, a rejected plan):
        recompute everything on a reset batch. Blocks in the prefix-cache index came from committed steps and stay
        valid unless the worker's KV itself is gone (the driver then calls `drop_cached()`). Snapshots the lost steps
        were saving are cancelled; confirmed ones stay valid as blocks do."""
        self.requeue_running()
        for req in self.waiting:
            req.on_worker = False
        if self.states is not None:  # snapshots the lost steps were saving never arrive
            for slot in list(self.states.pending):
                self.states.cancel(slot)
        self.to_drop.clear()
        self.reset_worker = True

    def drop_cached(self) -> None:
        """The worker's KV (and state) is gone or unknown: no cached block and no state snapshot is valid."""
        self.pool.drop_all_hashes()
        if self.states is not None:
            self.states.drop_all()

    # ---- one step -----------------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, now: float) -> SchedulerOutput:
        """Expire requests that waited too long, then decide the step. Preempted requests are marked for the
        worker to drop."""
        if self.queue_timeout > 0:
            for req in [r for r in self.waiting if r.scheduled_time is None
                        and now - r.arrival_time > self.queue_timeout]:
                self._finish(req, FINISH_TIMEOUT)
        out = schedule(self.waiting, self.running, self.pool, self.policy, self.states)
        for req in out.preempted:
            self._forget_on_worker(req)
        # Advance now, as if the step had run: the next step can then be planned while this one executes. A chunk
        # that reaches the end of the known tokens samples one: it is pending until the result brings it.
        for req in out.scheduled:
            out.num_computed_before[req.request_id] = req.num_computed_tokens
            req.num_computed_tokens += out.num_tokens[req.request_id]
            if req.num_computed_tokens == req.num_tokens:
                req.num_pending_tokens += 1
            req.num_draft_slots_in_flight += out.num_draft_slots.get(req.request_id, 0)
        if self.states is not None:
            if self.policy.snapshots:
                self._plan_snapshots(out)
            self.states.end_step()
        return out

    def update_from_output(self, out: SchedulerOutput, result: WorkerOutput, now: float) -> StepOutcome:
        """Apply an executed step: progress, prefix-cache registration, forks, sampled tokens and worker finishes."""
        outcome = StepOutcome()
        accepted = _accepted_drafts(out, result) if out.num_draft_slots else {}
        if out.state_saves:
            self._confirm_snapshots(out)
        for req in out.scheduled:
            if req.finished:
                continue  # finished (or aborted) while this step ran
            # The KV this step computed is now confirmed; a request preempted since holds no blocks to offer.
            confirmed = out.num_computed_before[req.request_id] + out.num_tokens[req.request_id]
            if req.status == Status.RUNNING and req.request_id in out.num_draft_slots:
                # Accepted drafts were query rows of this step: their KV is computed. Rejected positions hold
                # garbage KV past num_computed_tokens, overwritten by later steps; their blocks stay reserved
                # for the next step's drafts and are freed with the request.
                req.num_draft_slots_in_flight -= out.num_draft_slots[req.request_id]
                n_acc = accepted.get(req.request_id, 0)
                req.num_computed_tokens += n_acc
                confirmed += n_acc
            if req.status == Status.RUNNING:
                if self.policy.enable_prefix_caching:
                    self._register_computed_blocks(req, confirmed)
                if req.request_id in self.forks and confirmed >= req.num_prompt_tokens:
                    if self.states is None:
                        self._fork(req)
                    else:  # its siblings start from the prompt's snapshot and KV, through the prefix cache
                        self._release_forks(req, front=True)
            if req.scheduled_time is None:
                req.scheduled_time = now
                outcome.newly_scheduled.append(req)
        by_id = {r.request_id: r for r in out.scheduled}
        if result.prompt_scores or result.embeddings:
            prompt_results.attach(by_id, result.prompt_scores, result.embeddings)
        appended: dict[str, list] = {}
        for tok in result.tokens:
            req = by_id.get(tok.request_id)
            if req is None or req.finished:
                continue
            req.output_ids.append(tok.token_id)
            if tok.request_id not in appended:  # one pending token per step (more with accepted drafts)
                req.num_pending_tokens = max(0, req.num_pending_tokens - 1)
                appended[tok.request_id] = []
                outcome.appended.append((req, appended[tok.request_id]))
            appended[tok.request_id].append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
                outcome.first_token.append(req)
            if tok.finish:
                req.on_worker = False  # the worker forgot it already
                self._finish(req, _CLIENT_FINISH[tok.finish])
        return outcome

    def take_commit(self, step_id: int, out: SchedulerOutput | None = None, outcome: StepOutcome | None = None,
                    check_invariant: bool = False, finished_ttl_s: int = 600,
                    also_changed: SchedulerOutput | None = None, after_step_id: int | None = None) -> StepCommit:
        """Everything that changed since the last commit (this step's requests included), and reset the record.
        `also_changed`: a step scheduled after `out` whose allocations are already in the pool's changes;
        `after_step_id`: the step the ledger must already hold (StepCommit.after_step_id)."""
        finished = self._finished
        gone = {r.request_id for r in finished}
        changed = self._updated
        for o in (out, also_changed):
            if o is not None:
                changed = changed + o.scheduled + o.preempted
        updated = list({r.request_id: r for r in changed if r.request_id not in gone}.values())
        commit = StepCommit(
            step_id=step_id, arrival_seq=self.arrival_seq, new_requests=self._new, updated=updated,
            appended={r.request_id: [t.token_id for t in toks] for r, toks in (outcome.appended if outcome else [])},
            logprobs={r.request_id: [t.logprobs for t in toks] for r, toks in (outcome.appended if outcome else [])
                      if r.sampling.logprobs is not None},
            finished=finished, block_changes=self.pool.take_changes(),
            state_changes=self.states.take_changes() if self.states is not None else {},
            check_invariant=check_invariant,
            finished_ttl_s=finished_ttl_s, after_step_id=after_step_id)
        self._new, self._updated, self._finished = [], [], []
        return commit

    @property
    def has_uncommitted(self) -> bool:
        return bool(self._new or self._updated or self._finished)

    def check_invariant(self) -> None:
        """free + allocated == total, and every block owned by a live request is allocated; for a hybrid model every
        running request holds its own state slot and no waiting one holds any (raises AssertionError)."""
        self.pool.check([r.block_ids for r in self.running] + [r.block_ids for r in self.waiting])
        if self.states is not None:
            assert all(r.state_slot < 0 for r in self.waiting), "a waiting request holds a state slot"
            self.states.check({r.request_id: r.state_slot for r in self.running})

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _forget_on_worker(self, req: Request) -> None:
        if req.on_worker:
            self.to_drop.append(req.request_id)
            req.on_worker = False

    def _finish(self, req: Request, reason: str) -> None:
        """The one path that frees a request: finish, abort, timeout, rejection. Idempotent."""
        if req.finished:
            return
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req.fork_of in self.forks:
            self.forks[req.fork_of].remove(req)
        self._release_forks(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        self._release_state(req)
        self._forget_on_worker(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        self._finished.append(req)

    def _release_forks(self, first: Request, front: bool = False) -> None:
        """Siblings that can no longer fork from `first` queue on their own (the prefix cache still helps)."""
        siblings = self.forks.pop(first.request_id, None)
        if siblings and front:
            self.waiting.extendleft(reversed(siblings))
            self._updated.extend(siblings)
        elif siblings:
            self.waiting.extend(siblings)

    def _release_state(self, req: Request) -> None:
        if self.states is not None and req.state_slot >= 0:
            self.states.release(req.state_slot)
            req.state_slot = -1

    def _plan_snapshots(self, out: SchedulerOutput) -> None:
        """Hybrid prefix caching: the snapshots this step saves after its forward. A chunk that ends at the prompt's
        snapshot position (the policy cuts it there) saves the prompt's state; one that ends at a later block
        boundary saves the state there, replacing the request's previous such snapshot once confirmed, so that a
        finished sequence leaves the last boundary it reached (an agentic next turn extends it)."""
        bs = self.policy.block_size
        for req in out.scheduled:
            if skips_prefix_cache(req) or req.num_draft_slots_in_flight:
                continue  # a step verifying drafts ends where its acceptance says: no known position to save at
            end = out.num_computed_before[req.request_id] + out.num_tokens[req.request_id]
            at = prompt_snapshot_position(req, bs)
            if end % bs or end < at or end == 0:
                continue
            if end == at and self.states.lookup(req.full_block_hashes(bs)[end // bs - 1]) is not None:
                continue  # the prompt's snapshot exists already
            slot = self.states.reserve_snapshot(req.request_id)
            if slot is None:
                continue  # the snapshot budget is held by snapshots this step reads
            out.state_saves.append(PendingSave(req.request_id, req.state_slot, slot, end, decode=end > at))

    def _confirm_snapshots(self, out: SchedulerOutput) -> None:
        """The step ran: its saved snapshots enter the prefix-cache index, keyed by their prefix's hash. A request
        that had finished before the step (the worker skipped it) or was aborted meanwhile saved nothing valid."""
        by_id = {r.request_id: r for r in out.scheduled}
        bs = self.policy.block_size
        for save in out.state_saves:
            req = by_id[save.request_id]
            if req.finished or len(req.all_token_ids) < save.num_tokens:
                self.states.cancel(save.slot)
                continue
            key = req.full_block_hashes(bs)[save.num_tokens // bs - 1]
            if not self.states.confirm(save.slot, key, save.num_tokens) or not save.decode:
                continue
            if req.decode_snapshot is not None:
                slot, old = req.decode_snapshot
                snap = self.states.snapshot.get(slot)
                if snap is not None and snap.key == old:
                    self.states.drop(slot)
            req.decode_snapshot = (save.slot, key)

    def _fork(self, first: Request) -> None:
        """n > 1: the first sequence's prompt KV is computed; its siblings share those blocks and each computes
        only the last prompt token (into a copy-on-write block) to sample its own first token."""
        siblings = self.forks.pop(first.request_id)
        if len(self.running) + len(siblings) > self.policy.max_num_seqs:
            self.waiting.extend(siblings)
            return
        table = first.block_ids[: -(-first.num_prompt_tokens // self.policy.block_size)]
        for sib in siblings:
            self.pool.take(table)
            sib.block_ids = list(table)
            sib.num_computed_tokens = sib.num_prompt_tokens - 1
            sib.status = Status.RUNNING
            self.running.append(sib)
            self._updated.append(sib)

    def _register_computed_blocks(self, req: Request, computed: int) -> None:
        """Offer the request's full blocks computed by an executed step (`computed` tokens) to the prefix cache."""
        bs = self.policy.block_size
        full = min(computed // bs, len(req.block_ids), len(req.all_token_ids) // bs)
        if full <= req.num_registered_blocks:
            return
        hashes = req.full_block_hashes(bs)
        tokens = req.all_token_ids
        for i in range(req.num_registered_blocks, full):
            self.pool.register(req.block_ids[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
        req.num_registered_blocks = full
