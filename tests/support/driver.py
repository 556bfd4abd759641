"""A deliberately small test scheduler that drives a worker through StepPlans.

It exercises the worker protocol (new / cached requests, chunking, shuffled block tables,
staggered arrivals) without the real scheduler, so worker tests stay independent of it.
The real scheduler's end-to-end tests cover the same path through Redis.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from protos import worker_pb2 as pb
from tests.support.plans import Cached, Wire


@dataclass
class DriverRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: pb.SamplingParams
    arrival_step: int = 0
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False
    finish_reason: int = 0
    lora_name: str = ""  # a LoRA adapter ("": the base model) and its PEFT directory
    lora_path: str = ""


def run_requests(execute: Callable[[pb.StepPlan], pb.StepResult], requests: list[DriverRequest], *, chunk: int,
                 num_blocks: int, block_size: int, seed: int = 0, first_step_id: int = 1,
                 num_draft_slots: int = 0, spec_results: list[pb.StepResult] | None = None,
                 state_slots: bool = False) -> int:
    """Run every request to completion; each step gives each request up to `chunk` tokens.

    Blocks are handed out one at a time from a shuffled pool, so tables are non-contiguous.
    `num_draft_slots`: speculative decoding, each decode may verify that many drafts (prompt lookup 1..3); the
    results go to `spec_results` when given. `state_slots`: a hybrid model's requests each get the state slot of
    their index in `requests`. Returns the next free step id.
    """
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    for r in requests:
        r.tokens = list(r.prompt_ids)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    running: list[DriverRequest] = []
    step = first_step_id
    tick = 0
    wire = Wire()
    while pending or running:
        while pending and pending[0].arrival_step <= tick:
            running.append(pending.pop(0))
        tick += 1
        new, cached = [], []
        for r in running:
            n = min(chunk, len(r.tokens) - r.computed)
            k = num_draft_slots if r.sent and r.output and n == 1 else 0
            need = -(-(r.computed + n + k) // block_size) - len(r.blocks)
            new_blocks = [free.pop() for _ in range(max(0, need))]
            r.blocks += new_blocks
            if not r.sent:
                new.append(pb.NewRequest(request_id=r.request_id, prompt_token_ids=r.prompt_ids, sampling=r.sampling,
                                         block_ids=r.blocks, num_scheduled_tokens=n, lora_name=r.lora_name,
                                         lora_path=r.lora_path,
                                         **({"state_slot": requests.index(r)} if state_slots else {})))
                r.sent = True
            else:
                cached.append(Cached(r.request_id, n, new_blocks, num_draft_slots=k))
            r.computed += n
        if not running:
            continue
        lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if num_draft_slots else {}
        plan = wire.plan(step_id=step, new_requests=new, cached_requests=cached, **lookup)
        step += 1
        result = execute(plan)
        if spec_results is not None:
            spec_results.append(result)
        by_id = {r.request_id: r for r in running}
        got: set[str] = set()
        for t in wire.tokens(result):
            r = by_id[t.request_id]
            if t.request_id in got:
                r.computed += 1  # an accepted draft: its KV came with the step
            got.add(t.request_id)
            r.tokens.append(t.token_id)
            r.output.append(t.token_id)
            r.logprobs.append(t.logprob)
            if t.finish_reason:
                r.finish_reason = t.finish_reason
                free.extend(r.blocks)
                running.remove(r)
    return step
