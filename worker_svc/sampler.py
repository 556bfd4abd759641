"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The random draw for a request's token at position p is a pure function of (seed, p): a
generator seeded from a hash of (seed, p) draws one Exp(1) variable per vocabulary entry, and
the token is argmax(prob / noise) (the exponential race, equivalent to sampling from prob).
So a request's text depends neither on its batch companions nor on preemption and recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for one (request seed, token position) pair."""
    return _splitmix64(seed ^ _splitmix64(position)) >> 1  # torch seeds must fit in int64


def exponential_noise(seeds: list[int], positions: list[int], vocab_size: int) -> torch.Tensor:
    """[rows, vocab] Exp(1) draws; row i is a pure function of (seeds[i], positions[i])."""
    out = torch.empty(len(seeds), vocab_size, dtype=torch.float32)
    gen = torch.Generator()
    for i, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        gen.manual_seed(draw_seed(seed, pos))
        torch.rand(vocab_size, generator=gen, out=out[i])
    # rand is in [0, 1): 1 - u is in (0, 1], so the log is finite.
    return -torch.log1p(-out)


@dataclass
class SampleRow:
    """What the sampler needs to know about one request that samples this step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    position: int  # index the new token will have in prompt + output
    eos_ids: frozenset[int]


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """vLLM semantics: repetition over prompt + output; presence and frequency over output only."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.uses_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.int64)
        counts = torch.zeros(vocab, dtype=logits.dtype).scatter_add_(0, out, torch.ones(len(out), dtype=logits.dtype))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_ids, dtype=torch.int64)] = True
            penalized = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty, logits[i] * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, logits[i])
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            banned = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else set(row.eos_ids))
            if banned:
                logits[i, list(banned)] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside top-k, top-p and min-p (all vectorized over rows) with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    rank = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab)
    remove = rank >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (always keeps the first).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
    """logits: [len(rows), vocab] float32 (modified in place)."""
    logits = logits.float()
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    if any(r.params.uses_penalties for r in rows):
        _apply_penalties(logits, rows)
    if any(len(r.output_ids) < r.params.min_tokens for r in rows):
        _apply_min_tokens(logits, rows)

    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub = [rows[i] for i in random_rows]
        idx = torch.tensor(random_rows)
        temp = torch.tensor([r.params.temperature for r in sub], dtype=torch.float32)
        scaled = logits[idx] / temp[:, None]
        top_k = torch.tensor([r.params.top_k for r in sub])
        top_p = torch.tensor([r.params.top_p for r in sub], dtype=torch.float32)
        min_p = torch.tensor([r.params.min_p for r in sub], dtype=torch.float32)
        if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
            scaled = _filter(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        noise = exponential_noise([r.params.seed for r in sub], [r.position for r in sub], logits.shape[1])
        tokens[idx] = (probs / noise).argmax(dim=-1)

    token_list = tokens.tolist()
    out_lp: list[float | None] = [None] * len(rows)
    out_top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if raw_logprobs is not None:
        max_n = max((r.params.logprobs or 0) for r in rows)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n > 0 else (None, None)
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                continue
            out_lp[i] = chosen[i]
            n = r.params.logprobs
            if n and top_ids is not None:
                out_top[i] = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))
    return SampleOutput(token_list, out_lp, out_top)
