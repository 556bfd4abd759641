"""The plain data that flows through one scheduler step: plan -> worker result -> outcome -> Redis commit.

Nothing here does I/O. The worker client turns `SchedulerOutput` into the worker's wire plan and the wire result into
`WorkerOutput`; the store turns `StepCommit` into one Redis script call; observers read `StepRecord`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.core.block_pool import BlockState
from scheduler_svc.core.request import Request
from scheduler_svc.core.state_pool import PendingSave

# Why the waiting queue's head was not admitted in a step (`SchedulerOutput.admission_stopped_by`).
STOP_MAX_NUM_SEQS = "max_num_seqs"  # --max-num-seqs requests already run
STOP_TOKEN_BUDGET = "token_budget"  # the step's --max-num-batched-tokens are spent (or a whole prompt does not fit)
STOP_KV_CACHE = "kv_cache"  # not enough free KV blocks (or this step preempted: blocks go to running requests)
STOP_MAX_LORAS = "max_loras"  # the next request's LoRA adapter would be one more than --max-loras in the batch
STOP_BATCH_RUNNING = "batch_running"  # static / naive mode: no admission into a running batch
STOP_STATE_SLOTS = "state_slots"  # hybrid models: every state slot is held by a request (or read this step)


@dataclass
class SchedulerOutput:
    """What one iteration computes, as `schedule()` decided it.

    The worker keeps each request's state between steps, so a plan carries only what changed: a request the worker
    does not hold goes out whole (new or resumed), one it holds only as its new block ids and token count.
    """

    # Requests given tokens this step, in plan order (running first, then admitted). The worker client encodes
    # one plan entry per request; `update_from_output` advances exactly these.
    scheduled: list[Request] = field(default_factory=list)
    # request id -> tokens computed this step (the chunk). The sum is the step's size (metrics, tracing).
    num_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> blocks allocated this step: the only part of a held request's table the worker is sent.
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    # request id -> tokens whose KV was computed before this step: a new or resumed plan entry starts there, and
    # `update_from_output` confirms progress up to this plus the chunk (the request itself advanced already, when
    # the step was scheduled, so that the next step can be planned while this one runs).
    num_computed_before: dict[str, int] = field(default_factory=dict)
    # Running requests evicted to the queue's front (recompute): the worker must drop them; metrics count them.
    preempted: list[Request] = field(default_factory=list)
    # Waiting requests that joined the batch this step (tracing events, prefix-cache hit metrics).
    admitted: list[Request] = field(default_factory=list)
    # Copy-on-write (src, dst) block copies the worker makes before the forward (n > 1 siblings writing a shared
    # block).
    copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: request id -> draft positions the worker may verify after the request's one scheduled
    # token (budgeted and with KV blocks allocated; the worker proposes the drafts and may use fewer).
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    # Hybrid models: state slots copied (src, dst) before the forward (a snapshot into a joining request's slot),
    # and the snapshots saved after it (state_pool.PendingSave: the request's slot -> a reserved slot).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[PendingSave] = field(default_factory=list)
    # Requests whose block table changed in place (a copy replaced a shared block): the whole table is resent.
    replaced_tables: set[str] = field(default_factory=set)
    # Why admission stopped while requests still waited (one of the STOP_* values), None when the queue emptied
    # or was empty. Read by the admission-blocked metric and `llmserve diagnose`.
    admission_stopped_by: str | None = None
    # Split of the step for metrics and tracing: prompt positions computed (vllm:prompt_tokens_total counts
    # these), tokens of chunks that are not single-token decodes, and the number of decodes.
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    # Prefix caching, over the admitted requests: tokens looked up and tokens found (vllm:prefix_cache_*).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def unschedule(self, req: Request) -> int:
        """Take a (preempted) request back out of this step; returns the tokens it had."""
        if req.request_id not in self.num_tokens:
            return 0
        self.scheduled.remove(req)
        self.new_blocks.pop(req.request_id, None)
        self.num_computed_before.pop(req.request_id, None)
        if req.request_id in self.replaced_tables:
            self.replaced_tables.discard(req.request_id)
            mine = set(req.block_ids)
            self.copies = [(src, dst) for src, dst in self.copies if dst not in mine]
        return self.num_tokens.pop(req.request_id) + self.num_draft_slots.pop(req.request_id, 0)


@dataclass
class Logprobs:
    """The sampled token's log-probability and the top alternatives [(token id, logprob)]."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


# Worker finish reasons, decoded from the wire (FINISH_REASON_*): the worker checks EOS, stop token ids, max_tokens.
WORKER_EOS = "eos"
WORKER_STOP_TOKEN = "stop_token"
WORKER_MAX_TOKENS = "max_tokens"


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    finish: str | None = None  # WORKER_* when the worker ended the request with this token
    logprobs: Logprobs | None = None


@dataclass
class SpecStats:
    """Draft verification in one step (vllm:spec_decode_* metrics): requests that verified drafts, drafts
    verified, drafts accepted, and accepted per draft position (index 0 = the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class WorkerOutput:
    """One executed step as the worker reported it."""

    tokens: list[SampledToken] = field(default_factory=list)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0  # inside the model forward only (input tensors ready -> logits ready)
    sample_seconds: float = 0.0
    idle_seconds: float = 0.0  # the worker had no plan to run, before this step
    num_constrained: int = 0  # sampled rows masked by a structured-output grammar
    mask_seconds: float = 0.0  # filling and applying those masks, advancing the matchers
    spec: SpecStats | None = None  # speculative decoding, when some request verified drafts this step
    # Prompt logprobs scored and embeddings pooled this step (scheduler_svc/core/prompt_results.py).
    prompt_scores: list = field(default_factory=list)
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.prepare_seconds + self.forward_seconds + self.sample_seconds


@dataclass
class StepOutcome:
    """What `update_from_output` changed: the tokens to publish after the commit, and who got a first token."""

    appended: list[tuple[Request, list[SampledToken]]] = field(default_factory=list)
    first_token: list[Request] = field(default_factory=list)  # tracing events; TTFT
    newly_scheduled: list[Request] = field(default_factory=list)  # first step ever: queue time

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for _, t in self.appended)


@dataclass
class StepCommit:
    """Every change since the last commit, written to Redis in one atomic script call."""

    step_id: int
    arrival_seq: int
    new_requests: list[Request] = field(default_factory=list)  # full spec + state; out:{rid} starts empty
    updated: list[Request] = field(default_factory=list)  # status, num_computed_tokens, block_ids, ...
    appended: dict[str, list[int]] = field(default_factory=dict)  # rid -> tokens produced this step
    # rid -> those tokens' logprobs, for the requests that asked for them (sampling.logprobs set): stored so that a
    # stream re-attached to a new leader gets them with the tokens it re-sends.
    logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)  # final state, then expire
    block_changes: dict[int, BlockState] = field(default_factory=dict)  # from BlockPool.take_changes()
    state_changes: dict[int, str] = field(default_factory=dict)  # from StateSlotPool.take_changes() (hybrids)
    check_invariant: bool = False
    finished_ttl_s: int = 600
    # The step the ledger must hold before this one (the last this leader committed), or None: unchecked. A
    # fail-over to a lagging replica behind a connection that never broke would otherwise take this step's tokens
    # on top of outputs that lack the steps before it.
    after_step_id: int | None = None

    @property
    def empty(self) -> bool:
        return not (self.new_requests or self.updated or self.appended or self.finished or self.block_changes
                    or self.state_changes)


@dataclass
class StepRecord:
    """One iteration as observers (metrics, tracing, step log, timings) see it, filled in as the step goes."""

    step_id: int
    output: SchedulerOutput
    start: float  # time.perf_counter() when scheduling began
    start_ns: int  # wall clock (time.time_ns()) at the same moment, for spans
    now: float = 0.0  # wall clock when the worker's result came back
    outcome: StepOutcome = field(default_factory=StepOutcome)
    finished: list[Request] = field(default_factory=list)  # finished since the previous commit (any reason)
    worker: WorkerOutput | None = None
    worker_error: str | None = None  # the worker call failed (a status code name)
    commit_seconds: float = 0.0
    end: float = 0.0  # time.perf_counter() after the commit
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    state_usage: float = 0.0  # hybrid models: share of the state slots in use (requests and snapshots)
    num_state_snapshots: int = 0
    state_snapshot_share: float = 0.0
    trace: object = None  # the tracing observer's iteration span, parent of the worker call
    wait: Callable[[], WorkerOutput] | None = field(default=None, repr=False)  # the worker call in flight
