"""The rejection sampler on explicit distributions: the emitted tokens follow the target's distribution p (chi-square
over many seeded draws, so the test is deterministic), whatever the proposer's q; q == p accepts every draft; no
drafts is plain sampling; a seeded row repeats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from worker_svc.sampling.rejection import draft_keys, draw_from_probs, verify_drafts
from worker_svc.sampling.sampler import draw_keys

V, K, N = 8, 2, 20000


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(K + 1, V, generator=g), dim=-1)
    q = torch.softmax(2.0 * torch.randn(K, V, generator=g), dim=-1)
    p[0, 3] = 0.0  # a token the target never emits, which the proposer likes
    q[0, 3] += 0.3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def proposals(q: torch.Tensor, seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each row's drafts drawn from q, as a proposer does (its own salted keys)."""
    return np.stack([draw_from_probs(q[j].expand(len(seeds), V), draft_keys(seeds, positions + j))
                     for j in range(K)], axis=1)


def chi_square_p(tokens: np.ndarray, probs: torch.Tensor) -> float:
    seen = np.bincount(tokens, minlength=V).astype(np.float64)
    want = probs.double().numpy() * len(tokens)
    support = want > 0
    assert seen[~support].sum() == 0, "a token the target gives probability 0 was emitted"
    return float(stats.chisquare(seen[support], want[support] * seen.sum() / want[support].sum()).pvalue)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_emitted_tokens_follow_the_target_distribution(case):
    p, q = distributions(case)
    seeds = np.arange(N, dtype=np.uint64) + np.uint64(1000 * case)
    positions = np.full(N, 7, dtype=np.int64)
    drafts = proposals(q, seeds, positions)
    out = verify_drafts(p.expand(N, K + 1, V), q.expand(N, K, V), drafts, np.full(N, K), seeds, positions)
    assert (out.accepted >= 0).all() and (out.accepted <= K).all()
    assert 0 < out.accepted.mean() < K, "the case was meant to accept some drafts and reject others"
    assert chi_square_p(out.tokens[:, 0], p[0]) > 1e-3
    # The second token, where the first draft was accepted (position 1's p is the one after that draft).
    second = out.accepted >= 1
    assert chi_square_p(out.tokens[second, 1], p[1]) > 1e-3
    # Fewer drafts on some rows: the bonus comes one position earlier.
    short = verify_drafts(p.expand(N, K + 1, V), q.expand(N, K, V), drafts, np.full(N, 1), seeds, positions)
    assert short.accepted.max() <= 1
    assert chi_square_p(short.tokens[short.accepted == 1, 1], p[1]) > 1e-3


def test_a_proposer_equal_to_the_target_has_every_draft_accepted():
    p, _ = distributions(5)
    seeds = np.arange(500, dtype=np.uint64)
    positions = np.zeros(500, dtype=np.int64)
    drafts = proposals(p[:K], seeds, positions)
    out = verify_drafts(p.expand(500, K + 1, V), p[:K].expand(500, K, V), drafts, np.full(500, K), seeds, positions)
    assert (out.accepted == K).all()
    assert (out.tokens[:, :K] == drafts).all()


def test_no_drafts_is_plain_sampling_and_seeded_rows_repeat():
    p, q = distributions(7)
    seeds = np.arange(64, dtype=np.uint64) * np.uint64(7919)
    positions = np.arange(64, dtype=np.int64)
    drafts = proposals(q, seeds, positions)
    none = verify_drafts(p.expand(64, K + 1, V), q.expand(64, K, V), drafts, np.zeros(64), seeds, positions)
    plain = draw_from_probs(p[0].expand(64, V), draw_keys(seeds, positions))
    assert (none.accepted == 0).all() and (none.tokens[:, 0] == plain).all()
    a = verify_drafts(p.expand(64, K + 1, V), q.expand(64, K, V), drafts, np.full(64, K), seeds, positions)
    b = verify_drafts(p.expand(64, K + 1, V), q.expand(64, K, V), drafts, np.full(64, K), seeds, positions)
    assert (a.accepted == b.accepted).all() and (a.tokens == b.tokens).all()


def test_a_point_mass_proposal_is_verified_alike_by_both_draws():
    """ngram, eagle3 and mtp drafts are a point mass at x (q one-hot): the rejection sampler accepts with p(x) and
    else draws from p without x, which is what plain sampling's draw-and-compare does (the runner verifies those
    drafts that way, worker_svc/core/speculation.verifying_draw); both emit tokens with distribution p."""
    p, _ = distributions(0)
    x = int(p[0].argmax())
    q = torch.zeros(1, V)
    q[0, x] = 1.0
    seeds = np.arange(N, dtype=np.uint64) + np.uint64(5000)
    positions = np.full(N, 3, dtype=np.int64)
    out = verify_drafts(p[:2].expand(N, 2, V), q.expand(N, 1, V), np.full((N, 1), x), np.full(N, 1), seeds,
                        positions)
    plain = draw_from_probs(p[0].expand(N, V), draw_keys(seeds, positions))
    for accepted in (out.accepted == 1, plain == x):
        assert abs(accepted.mean() - float(p[0, x])) < 0.015
    assert chi_square_p(out.tokens[:, 0], p[0]) > 1e-3
    assert chi_square_p(plain, p[0]) > 1e-3
