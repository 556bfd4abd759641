"""The scheduling policy (vLLM V1 style), pure: queues, a block pool and limits in, a step out.

No prefill/decode phases: each request closes the gap between `num_tokens` and
`num_computed_tokens` as far as the token budget allows. Running requests go first; when the
pool runs dry the lowest-priority / latest request is preempted by recompute and goes to the
front of the waiting queue, and nothing new is admitted in that step.

Two older modes exist for benchmarks, on the same engine: `static` forms a batch only when nothing runs and
admits nobody until every member has finished; `naive` does the same one request at a time. Both prefill each
prompt whole in the admission step (the token budget does not split it), as a padded batch does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.speculative_config import SpeculativeConfig
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import step_records
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prompt_results import skips_prefix_cache
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.state_pool import StateSlotPool
from scheduler_svc.core.step_records import SchedulerOutput

_DEFAULTS = SchedulerConfig()  # the policy's defaults are the settings' (scheduler_svc/config.py)


@dataclass(frozen=True)
class PolicyConfig:
    """The limits the policy applies: the scheduler's settings, sized for the worker (leadership.sized_policy)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    enable_chunked_prefill: bool = _DEFAULTS.enable_chunked_prefill
    long_prefill_token_threshold: int = _DEFAULTS.long_prefill_token_threshold  # 0: off
    scheduling_policy: str = _DEFAULTS.scheduling_policy  # fcfs | priority
    enable_prefix_caching: bool = _DEFAULTS.enable_prefix_caching
    scheduling_mode: str = _DEFAULTS.scheduling_mode  # continuous | static | naive
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: off
    max_loras: int = 0  # distinct LoRA adapters among running requests (the worker's device pool); 0: LoRA off
    num_state_slots: int = 0  # hybrid models: the worker's state slots (leadership.sized_policy); 0: none
    state_snapshot_share: float = _DEFAULTS.state_snapshot_share  # hybrids: share of them prefix snapshots may hold

    @property
    def hybrid(self) -> bool:
        return self.num_state_slots > 0

    @property
    def max_state_snapshots(self) -> int:
        """The state slots prefix-cache snapshots may hold (--state-snapshot-share of them; none without caching)."""
        return int(self.state_snapshot_share * self.num_state_slots) if self.enable_prefix_caching else 0

    @property
    def snapshots(self) -> bool:
        """Hybrid prefix caching: recurrent state snapshots at block boundaries (docs/hybrid-models.md)."""
        return self.max_state_snapshots > 0

    @staticmethod
    def unsized(cfg: SchedulerConfig) -> PolicyConfig:
        """From the settings; 0 = size for the worker's device once it has described itself."""
        return PolicyConfig(max_num_batched_tokens=cfg.max_num_batched_tokens or 0,
                            max_num_seqs=cfg.max_num_seqs or 0, block_size=0,
                            enable_chunked_prefill=cfg.enable_chunked_prefill,
                            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                            scheduling_policy=cfg.scheduling_policy,
                            enable_prefix_caching=cfg.enable_prefix_caching,
                            scheduling_mode=cfg.scheduling_mode, speculative=cfg.speculative(),
                            max_loras=cfg.max_loras if cfg.enable_lora else 0,
                            state_snapshot_share=cfg.state_snapshot_share)



def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _sort_key(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival_seq)


def _pick_victim(running: list[Request], cfg: PolicyConfig) -> Request:
    if cfg.scheduling_policy == "priority":
        return max(running, key=_sort_key)  # largest value = lowest priority, latest arrival
    return running[-1]


def _preempt(victim: Request, running: list[Request], waiting: deque[Request], pool: BlockPool,
             states: StateSlotPool | None) -> None:
    running.remove(victim)
    pool.release(victim.block_ids)
    victim.block_ids = []
    if states is not None:  # its recurrent state is recomputed from zero (or a snapshot) when it is readmitted
        states.release(victim.state_slot)
        victim.state_slot = -1
    victim.num_computed_tokens = 0
    victim.num_registered_blocks = 0
    victim.num_draft_slots_in_flight = 0  # the worker drops it: whatever its steps in flight accept is recomputed
    victim.status = Status.WAITING
    victim.num_preemptions += 1
    waiting.appendleft(victim)


def _chunk(req: Request, budget: int, cfg: PolicyConfig) -> int:
    if len(req.output_ids) + req.num_pending_tokens >= req.max_tokens:
        return 0  # a step in flight samples its last token: nothing left to compute (pipelined scheduling)
    n = req.num_tokens - req.num_computed_tokens
    if cfg.long_prefill_token_threshold > 0:
        n = min(n, cfg.long_prefill_token_threshold)
    n = min(n, budget)
    if cfg.snapshots:
        # A state snapshot is taken after a step, so the chunk ends at the prompt's snapshot position when it
        # would pass it (docs/hybrid-models.md).
        at = prompt_snapshot_position(req, cfg.block_size)
        if req.num_computed_tokens < at < req.num_computed_tokens + n:
            n = at - req.num_computed_tokens
    return n


def prompt_snapshot_position(req: Request, block_size: int) -> int:
    """Hybrid prefix caching: where the prompt's snapshot is taken, its last full block boundary that a repeat of
    the prompt can use (a hit always leaves one token to compute); 0: the prompt is too short for one."""
    return (req.num_prompt_tokens - 1) // block_size * block_size


def _draft_slots(req: Request, n: int, budget: int, cfg: PolicyConfig) -> int:
    """Draft positions a decode (one token, the last known one) may verify after it: within the token budget and
    below max_tokens. Prefill chunks get none. Structured outputs draft too: the worker cuts their drafts where the
    grammar rejects one and masks each verified position at the grammar's state (worker_svc/core/grammar_drafts.py)."""
    if cfg.speculative is None or n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
        return 0
    if not (req.output_ids or req.num_pending_tokens):
        return 0  # the prompt's last token: no output to continue yet
    left = req.max_tokens - len(req.output_ids) - req.num_pending_tokens  # tokens this step may still add, >= 1
    return max(0, min(cfg.speculative.num_speculative_tokens, budget, left - 1))


def _shared_blocks_written(req: Request, n: int, pool: BlockPool, block_size: int) -> list[int]:
    """Indexes of blocks in req's table that tokens [computed, computed + n) write into and that are shared."""
    first = req.num_computed_tokens // block_size
    last = min(len(req.block_ids), blocks_for(req.num_computed_tokens + n, block_size))
    return [i for i in range(first, last) if pool.ref_counts[req.block_ids[i]] > 1]


def _cached_prefix(req: Request, pool: BlockPool, cfg: PolicyConfig,
                   states: StateSlotPool | None) -> tuple[list[int], int | None]:
    """Leading blocks of the request already computed in the pool; at least one token is always left to compute
    (its logits are needed), so a fully cached prompt recomputes its last block. A hybrid model's hit ends at the
    longest of those prefixes that has a state snapshot (KV alone does not give the recurrent layers their state):
    (blocks, the snapshot's slot)."""
    bs = cfg.block_size
    max_blocks = (req.num_tokens - 1) // bs
    hashes = req.full_block_hashes(bs)[:max_blocks]
    tokens = req.all_token_ids
    hits = pool.cached_prefix(hashes, (tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(hashes))))
    if states is None:
        return hits, None
    for k in range(len(hits), 0, -1):
        slot = states.lookup(hashes[k - 1])
        if slot is not None and states.snapshot[slot].num_tokens == k * bs:
            return hits[:k], slot
    return [], None


def schedule(waiting: deque[Request], running: list[Request], pool: BlockPool, cfg: PolicyConfig,
             states: StateSlotPool | None = None) -> SchedulerOutput:
    """Mutates the queues, the pools and the requests' block tables and state slots; returns the step."""
    out = SchedulerOutput()
    budget = cfg.max_num_batched_tokens
    continuous = cfg.scheduling_mode == "continuous"
    if not continuous and running:
        admit = False  # static / naive: no admission into a running batch
    else:
        admit = True

    # 1. Running requests, in order.
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = _chunk(req, budget, cfg)
        if n <= 0:
            i += 1
            continue
        k = _draft_slots(req, n, budget - n, cfg)
        # The KV this step may write: its chunk, its draft positions, and as many positions again as steps in
        # flight may have accepted beyond what this side knows (the worker places the chunk after those).
        span = n + k + req.num_draft_slots_in_flight
        # ... but never past the last KV position the request can need (its final token's KV is never computed).
        span = max(n, min(span, req.num_prompt_tokens + req.max_tokens - 1 - req.num_computed_tokens))
        # Blocks this chunk writes into that other sequences share (n > 1 forks) get a private copy first.
        shared = _shared_blocks_written(req, span, pool, cfg.block_size)
        need = blocks_for(req.num_computed_tokens + span, cfg.block_size) - len(req.block_ids) + len(shared)
        if k and need > pool.num_free:
            # Drafts never preempt anyone: without room for them the request decodes one token.
            span, k = span - k, 0
            shared = _shared_blocks_written(req, span, pool, cfg.block_size)
            need = blocks_for(req.num_computed_tokens + span, cfg.block_size) - len(req.block_ids) + len(shared)
        while need > pool.num_free:
            victim = _pick_victim(running, cfg)
            budget += out.unschedule(victim)
            if running.index(victim) < i:
                i -= 1
            _preempt(victim, running, waiting, pool, states)
            out.preempted.append(victim)
            if victim is req:
                break
            # The victim may have shared a block req was going to copy: if req now holds it alone, no copy.
            shared = _shared_blocks_written(req, span, pool, cfg.block_size)
            need = blocks_for(req.num_computed_tokens + span, cfg.block_size) - len(req.block_ids) + len(shared)
        if req.status != Status.RUNNING:
            continue  # req itself was the victim; `running[i]` is now the next request
        if shared:
            for idx in shared:
                old, (copy,) = req.block_ids[idx], pool.allocate(1)
                out.copies.append((old, copy))
                req.block_ids[idx] = copy
                pool.release([old])
            out.replaced_tables.add(req.request_id)
            need -= len(shared)
        new = pool.allocate(need) if need > 0 else []
        req.block_ids.extend(new)
        out.scheduled.append(req)
        out.num_tokens[req.request_id] = n
        out.new_blocks[req.request_id] = new
        if k:
            out.num_draft_slots[req.request_id] = k
        budget -= n + k
        i += 1

    if cfg.scheduling_policy == "priority" and waiting:
        ordered = sorted(waiting, key=_sort_key)
        waiting.clear()
        waiting.extend(ordered)

    # 2. Waiting requests, only when nothing was preempted (their blocks must go to running ones).
    max_seqs = 1 if cfg.scheduling_mode == "naive" else cfg.max_num_seqs
    # By name and directory, as the worker's pool holds them (a name reloaded from elsewhere is another adapter).
    adapters = {(r.lora_name, r.lora_path) for r in running if r.lora_name} if cfg.max_loras else set()
    while admit and not out.preempted and waiting and (budget > 0 or not continuous) and len(running) < max_seqs:
        req = waiting[0]
        lora = (req.lora_name, req.lora_path)
        if req.lora_name and cfg.max_loras and lora not in adapters and len(adapters) >= cfg.max_loras:
            out.admission_stopped_by = step_records.STOP_MAX_LORAS  # FCFS: it waits for an adapter's requests to end
            break
        remaining = req.num_tokens - req.num_computed_tokens
        if continuous and not cfg.enable_chunked_prefill and remaining > budget:
            out.admission_stopped_by = step_records.STOP_TOKEN_BUDGET
            break  # without chunking a prompt that does not fit the budget waits whole
        hits, snapshot = (_cached_prefix(req, pool, cfg, states) if cfg.enable_prefix_caching and not req.block_ids
                          and not skips_prefix_cache(req) else ([], None))
        if states is not None:
            if snapshot is not None:
                states.use(snapshot)  # kept from eviction in this step, before any slot is taken
            if states.num_available < 1:
                out.admission_stopped_by = step_records.STOP_STATE_SLOTS
                break
        req.num_computed_tokens += len(hits) * cfg.block_size
        n = _chunk(req, budget, cfg) if continuous else req.num_tokens - req.num_computed_tokens
        need = blocks_for(req.num_computed_tokens + n, cfg.block_size) - len(req.block_ids) - len(hits)
        # Evictable hits leave the free capacity once taken.
        if need > pool.num_free - pool.num_evictable_in(hits):
            req.num_computed_tokens -= len(hits) * cfg.block_size
            out.admission_stopped_by = step_records.STOP_KV_CACHE
            break
        waiting.popleft()
        pool.take(hits)
        req.num_cached_tokens = len(hits) * cfg.block_size
        if cfg.enable_prefix_caching:
            out.prefix_cache_queries += req.num_tokens
            out.prefix_cache_hits += req.num_cached_tokens
        req.num_registered_blocks = len(hits)
        new = pool.allocate(need) if need > 0 else []
        req.block_ids.extend(hits + new)
        if states is not None:
            req.state_slot = states.allocate(req.request_id)
            if snapshot is not None:
                out.state_copies.append((snapshot, req.state_slot))
        req.status = Status.RUNNING
        running.append(req)
        if req.lora_name:
            adapters.add(lora)
        out.admitted.append(req)
        out.scheduled.append(req)
        out.num_tokens[req.request_id] = n
        out.new_blocks[req.request_id] = new
        budget -= n
    if waiting and out.admission_stopped_by is None:
        out.admission_stopped_by = _why_not_admitted(out, admit, continuous, budget, len(running), max_seqs)
    _count_tokens(out)
    return out


def _why_not_admitted(out: SchedulerOutput, admit: bool, continuous: bool, budget: int, num_running: int,
                      max_seqs: int) -> str:
    """The loop condition that kept the waiting queue out, in the order the loop checks it."""
    if not admit:
        return step_records.STOP_BATCH_RUNNING
    if out.preempted:
        return step_records.STOP_KV_CACHE  # the pool ran dry: blocks go to running requests first
    if num_running >= max_seqs:
        return step_records.STOP_MAX_NUM_SEQS
    return step_records.STOP_TOKEN_BUDGET  # continuous mode with the budget spent


def _count_tokens(out: SchedulerOutput) -> None:
    """Prompt positions, prefill tokens and decodes of the step (called before the step advances anything)."""
    for req in out.scheduled:
        n = out.num_tokens[req.request_id]
        computed = req.num_computed_tokens
        out.num_prompt_tokens += max(0, min(computed + n, req.num_prompt_tokens) - computed)
        if n == 1 and computed == req.num_tokens - 1 and (req.output_ids or req.num_pending_tokens):
            out.num_decode_seqs += 1
        else:
            out.num_prefill_tokens += n
