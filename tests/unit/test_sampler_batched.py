"""Batched sampling against a simple per-row reference and against the per-row sampler it replaced
(tests/legacy_host_path.py), bit for bit, on random logits and random rows using every parameter: seeded
temperature with top-k / top-p / min-p, repetition / presence / frequency penalties, min_tokens with stop and EOS
tokens, logprobs. The rows reach the sampler as in the worker, through the persistent batch's columns; also with the
vectorized finish checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.sampling_fields import SamplingParams
from protos import worker_pb2 as pb
from tests.support import legacy_host_path as legacy
from tests.support.legacy_host_path import SampleRow
from tests.unit.test_sampler import sampling_batch
from worker_svc.core.persistent_batch import BatchLimits, PersistentBatch
from worker_svc.sampling import sampler
from worker_svc.sampling.sampler import (
    BatchSample,
    _filter,
    apply_min_tokens,
    apply_penalties,
    draw_keys,
    draw_tokens,
    greedy_batch,
    sample_batch,
)
from worker_svc.wire import sampling_to_wire, step_plan

EOS = frozenset({0, 3})


def batch_of_rows(rows: list[SampleRow]) -> sampler.SamplingBatch:
    """Rows sample the token after their prompt + output, all with the same EOS ids."""
    assert all(r.position == len(r.prompt_ids) + len(r.output_ids) and r.eos_ids == rows[0].eos_ids for r in rows)
    return sampling_batch([(r.params, r.prompt_ids, r.output_ids) for r in rows], eos=sorted(rows[0].eos_ids))


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> legacy.SampleOutput:
    """The batched sampler's result per row, as the per-row sampler gave it."""
    out: BatchSample = sample_batch(logits, batch_of_rows(rows))
    logprobs: list[float | None] = [None] * len(rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    for i, lp, t in zip(out.logprob_rows, out.logprobs, out.top_logprobs, strict=True):
        logprobs[i], top[i] = lp, t
    return legacy.SampleOutput(out.token_ids.tolist(), logprobs, top)


def random_params(rng: random.Random, vocab: int, *, filters: bool = True) -> SamplingParams:
    f32 = lambda x: float(np.float32(x))  # noqa: E731 -- the proto's floats
    return SamplingParams(
        temperature=f32(rng.choice([0.0, 0.0, 0.5, 1.3])),
        top_k=rng.choice([0, -1, 1, 5, 40]) if filters else rng.choice([0, -1]),
        top_p=f32(rng.choice([1.0, 0.9, 0.5])) if filters else 1.0,
        min_p=f32(rng.choice([0.0, 0.1])) if filters else 0.0,
        repetition_penalty=f32(rng.choice([1.0, 1.0, 1.3, 0.8])),
        presence_penalty=f32(rng.choice([0.0, 0.0, 0.5, -0.3])),
        frequency_penalty=f32(rng.choice([0.0, 0.0, 0.2])),
        seed=rng.randrange(1 << 64),
        ignore_eos=rng.random() < 0.3,
        min_tokens=rng.choice([0, 0, 3, 10]),
        max_tokens=rng.choice([0, 5, 12]),
        stop_token_ids=frozenset(rng.sample(range(vocab), rng.choice([0, 0, 1, 3]))),
        logprobs=rng.choice([None, None, 0, 3, 7]),
    )


def random_case(seed: int, *, filters: bool = True):
    rng = random.Random(seed)
    vocab = rng.choice([16, 64, 257])
    n = rng.choice([1, 2, 7, 33])
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
        rows.append(SampleRow(random_params(rng, vocab, filters=filters), prompt, output, len(prompt) + len(output),
                              EOS))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    if rng.random() < 0.3:
        logits = logits.round()  # ties
    return rows, logits


def reference_row(logits: torch.Tensor, row: SampleRow, filter_all: bool, max_n: int):
    """One row alone. `filter_all`: whether the batch filtered its random rows (it filters all of them when any
    needs it); `max_n`: the batch's largest logprobs (its top-k is taken once, at that size)."""
    p, x = row.params, logits.clone()
    vocab = x.shape[0]
    raw = torch.log_softmax(x, dim=-1)
    if p.uses_penalties:
        counts = torch.bincount(torch.tensor(row.output_ids, dtype=torch.int64), minlength=vocab).float()
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_ids)] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
    if len(row.output_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_ids))
        x[list(banned)] = float("-inf")
    if p.greedy:
        token = int(x.argmax())
    else:
        scaled = (x / torch.tensor(p.temperature))[None]
        if filter_all:
            scaled = _filter(scaled, torch.tensor([p.top_k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
        token = int(draw_tokens(scaled, draw_keys([p.seed], [row.position]))[0])
    if p.logprobs is None:
        return token, None, []
    vals, ids = raw.topk(max_n) if max_n else (torch.empty(0), torch.empty(0, dtype=torch.int64))
    return token, raw[token].item(), list(zip(ids[: p.logprobs].tolist(), vals[: p.logprobs].tolist(), strict=True))


def filters_any(rows: list[SampleRow]) -> bool:
    rand = [r.params for r in rows if not r.params.greedy]
    return any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in rand)


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_the_per_row_reference_and_the_old_sampler(seed):
    rows, logits = random_case(seed, filters=seed % 4 != 0)
    got = sample(logits.clone(), rows)
    old = legacy.sample(logits.clone(), rows)
    assert (got.token_ids, got.logprobs, got.top_logprobs) == (old.token_ids, old.logprobs, old.top_logprobs)
    max_n = max((r.params.logprobs or 0) for r in rows)
    for i, r in enumerate(rows):
        assert (got.token_ids[i], got.logprobs[i], got.top_logprobs[i]) == reference_row(
            logits[i], r, filters_any(rows), max_n), f"row {i}: {r.params}"


@pytest.mark.parametrize("seed", range(20))
def test_penalties_and_bans_change_the_logits_exactly_as_before(seed):
    rows, logits = random_case(seed)
    new, old = logits.clone(), logits.clone()
    apply_penalties(new, batch_of_rows(rows))
    apply_min_tokens(new, batch_of_rows(rows))
    legacy._apply_penalties(old, rows)
    legacy._apply_min_tokens(old, rows)
    assert torch.equal(new, old)


def test_random_rows_are_all_filtered_when_one_needs_it(monkeypatch):
    """The filter is not exactly a no-op for a row without top-k / top-p / min-p (the cumulative mass can round
    to 1 before the tail), so whether it runs must not depend on which rows happen to share the batch differently
    than before: all random rows when any needs it, none otherwise."""
    filtered: list[int] = []
    monkeypatch.setattr(sampler, "_filter", lambda x, *a: filtered.append(len(x)) or x)
    plain, top_p = SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_p=0.5, seed=2)
    logits = torch.randn(3, 10)
    sample(logits.clone(), [SampleRow(p, [1], [], 1, EOS) for p in (plain, SamplingParams(temperature=0.0), plain)])
    sample(logits.clone(), [SampleRow(p, [1], [], 1, EOS) for p in (plain, SamplingParams(temperature=0.0), top_p)])
    assert filtered == [2]


def test_greedy_rows_need_only_the_argmax():
    logits = torch.randn(50, 300, generator=torch.Generator().manual_seed(1)).round()  # many ties
    logits[3] = float("-inf")
    rows = [SampleRow(SamplingParams(temperature=0.0), [1], [], 1, EOS) for _ in range(50)]
    assert greedy_batch(logits).token_ids.tolist() == sample(logits.clone(), rows).token_ids
    assert greedy_batch(logits).token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(12))
def test_through_the_persistent_batch_with_finish_checks(seed):
    """Rows built from plans (resumed requests carry output tokens), sampled from the batch's columns, finished
    by the vectorized checks: as the old runner did it row by row."""
    rows, logits = random_case(100 + seed)
    vocab, max_model_len = logits.shape[1], 40
    batch = PersistentBatch(BatchLimits(num_blocks=1000, block_size=4, max_model_len=max_model_len, vocab_size=vocab))
    plan = pb.StepPlan(step_id=1)
    for i, r in enumerate(rows):
        ids = r.prompt_ids + r.output_ids
        plan.resumed_requests.add(slot=i, request_id=f"r{i}", token_ids=ids, num_prompt_tokens=len(r.prompt_ids),
                                  sampling=sampling_to_wire(r.params), block_ids=range(i * 10, i * 10 + 10))
    p = step_plan(plan)
    batch.apply_plan(p, batch.check_plan(p, "e"))
    inputs = batch.inputs
    order = np.array([inputs.row_of[f"r{i}"] for i in range(len(rows))], dtype=np.int64)
    eos = np.array(sorted(EOS), dtype=np.int64)
    got = sample_batch(logits.clone(), inputs.sampling_batch(order, eos))
    old = legacy.sample(logits.clone(), rows)
    assert got.token_ids.tolist() == old.token_ids
    assert [got.logprobs[got.logprob_rows.index(i)] if i in got.logprob_rows else None
            for i in range(len(rows))] == old.logprobs

    # Finish checks on the sampled tokens, and on hand-picked ones (EOS, a stop token) to hit every branch.
    for tokens in (got.token_ids, np.array([sorted(r.params.stop_token_ids or EOS)[0] for r in rows])):
        inputs.append_tokens(order, tokens)
        reasons = inputs.finish_reasons(order, eos).tolist()
        expected = [legacy.finish_reason(r.params, r.prompt_ids + r.output_ids + [int(t)], len(r.prompt_ids), EOS,
                                         max_model_len) for r, t in zip(rows, tokens, strict=True)]
        assert reasons == expected
        for r, t in zip(rows, tokens, strict=True):
            r.output_ids.append(int(t))


def test_finish_reasons_cover_every_branch():
    """min_tokens holds back EOS and stop, not the length; EOS beats stop beats length."""
    batch = PersistentBatch(BatchLimits(num_blocks=100, block_size=4, max_model_len=12, vocab_size=20))
    cases = [  # (sampling, output so far, next token, expected)
        (pb.SamplingParams(), [5], 0, pb.FINISH_REASON_EOS),
        (pb.SamplingParams(ignore_eos=True), [5], 0, pb.FINISH_REASON_NONE),
        (pb.SamplingParams(stop_token_ids=[7]), [5], 7, pb.FINISH_REASON_STOP_TOKEN),
        (pb.SamplingParams(stop_token_ids=[0]), [5], 0, pb.FINISH_REASON_EOS),
        (pb.SamplingParams(min_tokens=3, stop_token_ids=[7]), [5], 7, pb.FINISH_REASON_NONE),
        (pb.SamplingParams(min_tokens=2, max_tokens=2), [5], 0, pb.FINISH_REASON_EOS),
        (pb.SamplingParams(min_tokens=3, max_tokens=2), [5], 0, pb.FINISH_REASON_MAX_TOKENS),
        (pb.SamplingParams(max_tokens=2), [5], 9, pb.FINISH_REASON_MAX_TOKENS),
        (pb.SamplingParams(), [5] * 8, 9, pb.FINISH_REASON_MAX_TOKENS),  # 3 + 9 tokens reach max_model_len 12
        (pb.SamplingParams(), [5] * 7, 9, pb.FINISH_REASON_NONE),
    ]
    plan = pb.StepPlan(step_id=1)
    for i, (sp, out, _, _) in enumerate(cases):
        plan.resumed_requests.add(slot=i, request_id=f"r{i}", token_ids=[1, 1, 1, *out], num_prompt_tokens=3,
                                  sampling=sp, block_ids=[i * 3, i * 3 + 1, i * 3 + 2])
    p = step_plan(plan)
    batch.apply_plan(p, batch.check_plan(p, "e"))
    rows = np.array([batch.inputs.row_of[f"r{i}"] for i in range(len(cases))], dtype=np.int64)
    batch.inputs.append_tokens(rows, np.array([c[2] for c in cases]))
    assert batch.inputs.finish_reasons(rows, np.array([0])).tolist() == [c[3] for c in cases]
