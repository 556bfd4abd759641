"""What a step computes over a prompt besides its KV: prompt logprobs (vLLM's `prompt_logprobs`) and embeddings.

The worker returns them with the step that computed the rows (a chunked prompt's logprobs come chunk by chunk);
they stay on the scheduler's Request, beside its sampled logprobs, and the outbox hands them to the client with the
request's first token (prompt logprobs) or its finish (the embedding). Like sampled logprobs they are not written
to Redis: a new leader resumes an unfinished request by recomputing its prompt, and such requests never read the
prefix cache (scheduler_svc/core/policy.py), so that recompute scores (or pools) every prompt token again. A position
computed twice (preemption) is overwritten with the same value: nothing is duplicated.

Plain data: no protobuf, gRPC or Redis here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import Logprobs


@dataclass
class PromptScores:
    """Prompt tokens start .. start + len(logprobs) - 1 of one request, scored by one step."""

    request_id: str
    start: int
    logprobs: list[Logprobs] = field(default_factory=list)


def skips_prefix_cache(req: Request) -> bool:
    """Every prompt position must be computed: the prefix cache would skip some."""
    return req.sampling.prompt_logprobs is not None or req.sampling.embed


def decode(slots, starts, counts, num_top, values, top_ids, top_values,
           owners: list[str | None]) -> list[PromptScores]:
    """The wire's packed prompt_lp_* arrays (per entry: slot, first position, count, top count; per token: value,
    top ids and values) as one PromptScores per entry."""
    out, at, top_at = [], 0, 0
    for slot, start, n, k in zip(slots, starts, counts, num_top, strict=True):
        scores = PromptScores(owners[slot], start)
        for j in range(n):  # prompt tokens of the few requests that asked
            scores.logprobs.append(Logprobs(values[at + j], list(zip(top_ids[top_at: top_at + k],
                                                                      top_values[top_at: top_at + k], strict=True))))
            top_at += k
        at += n
        out.append(scores)
    return out


def attach(by_id: dict[str, Request], scores: list[PromptScores], embeddings: dict[str, list[float]]) -> None:
    """Keep a step's prompt results on their requests (position-indexed: a recompute overwrites)."""
    for s in scores:
        req = by_id.get(s.request_id)
        if req is None or req.finished:
            continue
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        req.prompt_logprobs[s.start: s.start + len(s.logprobs)] = s.logprobs
    for rid, vector in embeddings.items():
        req = by_id.get(rid)
        if req is not None and not req.finished:
            req.embedding = vector


def complete_prompt_logprobs(req: Request) -> list[Logprobs | None] | None:
    """The request's prompt logprobs once every prompt token from the second on is scored (the first has none)."""
    lps = req.prompt_logprobs
    if req.sampling.prompt_logprobs is None:
        return None
    if req.num_prompt_tokens == 1:
        return [None]
    if lps is None or any(lp is None for lp in lps[1:]):
        return None
    return list(lps)
