"""The scheduling policy (vLLM V1 style), pure: queues, a block pool and limits in, a step out.

No prefill/decode phases: each request closes the gap between `num_tokens` and
`num_computed_tokens` as far as the token budget allows. Running requests go first; when the
pool runs dry the lowest-priority / latest request is preempted by recompute and goes to the
front of the waiting queue, and nothing new is admitted in that step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import Request, Status


@dataclass(frozen=True)
class PolicyConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: off
    scheduling_policy: str = "fcfs"  # fcfs | priority


@dataclass
class StepSchedule:
    """What one iteration computes. `scheduled` keeps plan order: running first, then admitted."""

    scheduled: list[Request] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def unschedule(self, req: Request) -> int:
        """Take a (preempted) request back out of this step; returns the tokens it had."""
        if req.request_id not in self.num_tokens:
            return 0
        self.scheduled.remove(req)
        self.new_blocks.pop(req.request_id, None)
        return self.num_tokens.pop(req.request_id)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _sort_key(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival_seq)


def _pick_victim(running: list[Request], cfg: PolicyConfig) -> Request:
    if cfg.scheduling_policy == "priority":
        return max(running, key=_sort_key)  # largest value = lowest priority, latest arrival
    return running[-1]


def _preempt(victim: Request, running: list[Request], waiting: deque[Request], pool: BlockPool) -> None:
    running.remove(victim)
    pool.release(victim.block_ids)
    victim.block_ids = []
    victim.num_computed_tokens = 0
    victim.status = Status.WAITING
    victim.num_preemptions += 1
    waiting.appendleft(victim)


def _chunk(req: Request, budget: int, cfg: PolicyConfig) -> int:
    n = req.num_tokens - req.num_computed_tokens
    if cfg.long_prefill_token_threshold > 0:
        n = min(n, cfg.long_prefill_token_threshold)
    return min(n, budget)


def schedule(waiting: deque[Request], running: list[Request], pool: BlockPool, cfg: PolicyConfig) -> StepSchedule:
    """Mutates the queues, the pool and the requests' block tables; returns the step."""
    out = StepSchedule()
    budget = cfg.max_num_batched_tokens

    # 1. Running requests, in order.
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = _chunk(req, budget, cfg)
        if n <= 0:
            i += 1
            continue
        need = blocks_for(req.num_computed_tokens + n, cfg.block_size) - len(req.block_ids)
        while need > pool.num_free:
            victim = _pick_victim(running, cfg)
            budget += out.unschedule(victim)
            if running.index(victim) < i:
                i -= 1
            _preempt(victim, running, waiting, pool)
            out.preempted.append(victim)
            if victim is req:
                break
        if req.status != Status.RUNNING:
            continue  # req itself was the victim; `running[i]` is now the next request
        new = pool.allocate(need) if need > 0 else []
        req.block_ids.extend(new)
        out.scheduled.append(req)
        out.num_tokens[req.request_id] = n
        out.new_blocks[req.request_id] = new
        budget -= n
        i += 1

    if cfg.scheduling_policy == "priority" and waiting:
        ordered = sorted(waiting, key=_sort_key)
        waiting.clear()
        waiting.extend(ordered)

    # 2. Waiting requests, only when nothing was preempted (their blocks must go to running ones).
    while not out.preempted and waiting and budget > 0 and len(running) < cfg.max_num_seqs:
        req = waiting[0]
        remaining = req.num_tokens - req.num_computed_tokens
        if not cfg.enable_chunked_prefill and remaining > budget:
            break  # without chunking a prompt that does not fit the budget waits whole
        n = _chunk(req, budget, cfg)
        need = blocks_for(req.num_computed_tokens + n, cfg.block_size) - len(req.block_ids)
        if need > pool.num_free:
            break
        waiting.popleft()
        new = pool.allocate(need) if need > 0 else []
        req.block_ids.extend(new)
        req.status = Status.RUNNING
        running.append(req)
        out.admitted.append(req)
        out.scheduled.append(req)
        out.num_tokens[req.request_id] = n
        out.new_blocks[req.request_id] = new
        budget -= n
    return out
