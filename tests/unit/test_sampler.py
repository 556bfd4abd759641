"""Sampler unit tests on explicit logits (the model-driven versions live in test_worker_runner.py). Requests become
the sampler's columns as in the worker: rows of the persistent input batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from common.sampling_fields import SamplingParams
from tests.support.cpu_tiers import kernel_test_tiers, tier_ops
from worker_svc.core.input_batch import InputBatch
from worker_svc.sampling.sampler import (
    BatchSample,
    SamplingBatch,
    apply_penalties,
    draw_keys,
    draw_tokens,
    exponential_noise,
    sample_batch,
)

V = 64
Row = tuple[SamplingParams, Sequence[int], Sequence[int]]  # params, prompt, output so far


def row(params: SamplingParams, output=(), prompt=(1, 2, 3)) -> Row:
    return params, prompt, output


def sampling_batch(rows: Sequence[Row], eos: Sequence[int] = (0,), repeat: np.ndarray | None = None,
                   offsets: np.ndarray | None = None) -> SamplingBatch:
    """The sampler's view of `rows` (each samples the token after its prompt + output). `repeat` samples the given
    rows instead, `offsets[i]` positions further on (as speculative verification does)."""
    inputs = InputBatch(max_model_len=1 << 16)
    for i, (p, prompt, output) in enumerate(rows):
        inputs.add(i, f"r{i}", [*prompt, *output], len(prompt), p, [], 0)
    which = np.arange(len(rows)) if repeat is None else repeat
    return inputs.sampling_batch(which, np.array(sorted(eos), dtype=np.int64), offsets)


def sample(logits: torch.Tensor, rows: Sequence[Row], **kw) -> BatchSample:
    return sample_batch(logits, sampling_batch(rows, **kw))


def tokens(logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
    return sample(logits, rows).token_ids.tolist()


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 2


def test_greedy_and_top_k_1_pick_argmax():
    lg = logits_for(4)
    greedy = tokens(lg.clone(), [row(SamplingParams(temperature=0.0))] * 4)
    topk1 = tokens(lg.clone(), [row(SamplingParams(temperature=1.5, top_k=1, seed=s)) for s in range(4)])
    assert greedy == lg.argmax(-1).tolist() == topk1


def test_same_seed_same_token_whatever_the_companions():
    lg = logits_for(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = tokens(lg.clone(), [row(p)])[0]
    others = logits_for(5, seed=9)
    mixed = torch.cat([others[:2], lg, others[2:]])
    rows = [row(SamplingParams(temperature=0.7, seed=i)) for i in range(2)] + [row(p)]
    rows += [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=2.0, top_p=0.5, seed=5)),
             row(SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=6), output=[4, 5])]
    assert tokens(mixed.clone(), rows)[2] == alone


def test_noise_is_a_function_of_seed_and_position():
    a = exponential_noise(draw_keys([7, 7, 8], [100, 101, 100]), V)
    b = exponential_noise(draw_keys([7], [100]), V)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and bool(torch.isfinite(a).all())


@pytest.fixture(params=kernel_test_tiers())
def ops(request, monkeypatch):
    """kernels/csrc/sampling.cpp built for one ISA tier (tests/support/cpu_tiers.py), the process's default meanwhile"""
    return tier_ops(request.param, monkeypatch)


def test_the_cpu_kernel_draws_what_the_torch_form_draws(ops):
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(32, 5000, generator=g) * 3
    scaled[:, ::7] = float("-inf")  # masked tokens are never drawn
    keys = draw_keys(np.arange(32), np.arange(32) * 11)
    weights = (scaled - scaled.amax(-1, keepdim=True)).exp()
    want = (weights / exponential_noise(keys, 5000)).argmax(-1)
    got = ops.sample_rows(scaled.contiguous(), torch.from_numpy(keys.view(np.int64)))
    assert got.tolist() == want.tolist() and bool((got % 7 != 0).all())
    assert draw_tokens(scaled, keys).tolist() == want.tolist()


def test_the_cpu_kernel_picks_the_first_best_token(ops):
    """Ties go to the first index (the torch argmax's rule), inside a 16-wide chunk, across chunks and in the tail;
    a row with every token masked gives token 0."""
    V = 16 * 9 + 5
    scaled = torch.full((4, V), float("-inf"))
    scaled[0, [3, 40]] = 0.0  # the two weights equal: the draws decide; both candidates stay in range
    scaled[1, V - 2] = 0.0  # one token left, in the tail
    scaled[2, 20] = 0.0
    keys = draw_keys(np.arange(4), np.zeros(4, dtype=np.int64))
    got = ops.sample_rows(scaled.contiguous(), torch.from_numpy(keys.view(np.int64))).tolist()
    weights = (scaled[:3] - scaled[:3].amax(-1, keepdim=True)).exp()
    assert got[:3] == (weights / exponential_noise(keys[:3], V)).argmax(-1).tolist()
    assert got[1:] == [V - 2, 20, 0]


def test_masking_a_token_that_would_not_win_changes_no_draw():
    # the property logit_bias / bad_words / grammars rely on (tests/e2e/test_openai_api.py's replay with bans)
    g = torch.Generator().manual_seed(1)
    scaled = torch.randn(64, 3000, generator=g)
    keys = draw_keys(np.arange(64), np.zeros(64, dtype=np.int64))
    first = draw_tokens(scaled, keys)
    masked = scaled.clone()
    losers = torch.ones_like(masked, dtype=torch.bool)
    losers[torch.arange(64), torch.from_numpy(first)] = False
    masked[losers & (torch.rand(masked.shape, generator=g) < 0.5)] = float("-inf")
    assert draw_tokens(masked, keys).tolist() == first.tolist()


def test_different_seeds_give_different_samples():
    lg = torch.zeros(1, V)  # uniform distribution: seeds must spread out
    draws = set(tokens(lg.expand(40, V).clone(), [row(SamplingParams(temperature=1.0, seed=s)) for s in range(40)]))
    assert len(draws) > 15


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    lg = torch.log(probs.clamp_min(1e-30))[None]
    n = 3000  # one request, sampled at n positions
    picked = sample(lg.expand(n, V).clone(), [row(SamplingParams(temperature=1.0, seed=42))],
                    repeat=np.zeros(n, dtype=np.int64), offsets=np.arange(n)).token_ids
    counts = torch.bincount(torch.from_numpy(picked), minlength=V).float()
    freq = counts / counts.sum()
    assert torch.allclose(freq[:3], probs[:3], atol=0.04)
    assert counts[3:].sum() == 0


def test_top_p_and_min_p_restrict_the_support():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4))
    lg = torch.log(probs.clamp_min(1e-30))[None]
    def support(**kw) -> set[int]:
        return set(tokens(lg.expand(200, V).clone(), [row(SamplingParams(temperature=1.0, seed=s, **kw))
                                                      for s in range(200)]))

    assert support(top_p=0.6) == {0, 1}  # 0.4 < 0.6, 0.4 + 0.3 >= 0.6: token 2 and beyond are cut
    assert support(min_p=0.6) == {0, 1}  # keeps p >= 0.6 * 0.4 = 0.24
    assert support(top_k=3) == {0, 1, 2}


def test_penalties_follow_vllm_semantics():
    lg = torch.tensor([[2.0, -1.0, 0.5, 3.0] + [-10.0] * (V - 4)])
    # Repetition: seen tokens (prompt 0, output 1) are divided (positive) or multiplied (negative).
    out = lg.clone()
    apply_penalties(out, sampling_batch([row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])]))
    assert out[0, :4].tolist() == [1.0, -2.0, 0.5, 3.0]
    # Presence (once per seen token) and frequency (per occurrence) over the output only.
    out = lg.clone()
    apply_penalties(out, sampling_batch([row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                             prompt=[2], output=[3, 3, 1])]))
    assert out[0, :4].tolist() == [2.0, -1.0 - 0.75, 0.5, 3.0 - 1.0]
    # And the greedy choice moves: token 3 is penalized below token 0.
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert tokens(lg.clone(), [row(p, output=[3, 3])]) == [0]


def test_min_tokens_blocks_eos_and_stop_tokens():
    lg = torch.full((1, V), -5.0)
    lg[0, 0] = 10.0  # eos
    lg[0, 5] = 9.0  # stop token
    lg[0, 7] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    assert tokens(lg.clone(), [row(p, output=[9])]) == [7]
    assert tokens(lg.clone(), [row(p, output=[9, 9, 9])]) == [0]


def test_logprobs_are_raw_log_softmax_with_top_n():
    lg = logits_for(2)
    out = sample(lg.clone(), [row(SamplingParams(temperature=0.0, logprobs=3)), row(SamplingParams(temperature=0.0))])
    ref = torch.log_softmax(lg, -1)
    assert out.logprob_rows == [0]  # only the row that asked
    assert abs(out.logprobs[0] - ref[0].max().item()) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == ref[0].topk(3).indices.tolist()
