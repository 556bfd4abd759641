"""Rejection sampling for speculative decoding with a proposer that has a distribution (a draft model, a head).

Pure: probabilities and token ids in, accepted counts and emitted tokens out, no model, batch or Redis. Any
proposer that samples its drafts from a distribution q (draft_model, EAGLE-3, MTP) verifies them here:

    verify_drafts(p, q, drafts, num_drafts, seeds, positions) -> Verified(accepted, tokens)

- p: [R, K + 1, V] the target's probabilities at each verified position (position j follows drafts[:, :j]);
- q: [R, K, V] the proposer's probabilities the drafts were drawn from;
- drafts: [R, K] the draft tokens; num_drafts: [R] how many of them row r has (<= K; the rest is padding);
- seeds, positions: row r's seed and the index (in prompt + output) of its first verified token.

p and q must be the distributions after the request's own processing (penalties, temperature, top-k, top-p,
min-p), the same processing for both. Draft j is accepted with probability min(1, p(x) / q(x)); at the first
rejection the token is drawn from normalize(max(p - q, 0)); when every draft is accepted the bonus token is drawn
from p at position K + 1. So the emitted text has the target's distribution (Leviathan et al. 2023).

Randomness is the sampler's (worker_svc/sampling/sampler.py): every draw is a pure function of (seed, position),
so a seeded request repeats across batches, preemption and recompute. The acceptance test and the proposer's own
draws use salted keys, independent of the target's draw at the same position; the recovered and the bonus token
use the target's own (seed, position) noise, so with no drafts this is exactly plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.sampling.sampler import draw_keys, draw_tokens

# Salts on the seed so the three kinds of draw at one position are independent of one another.
_ACCEPT_SALT = np.uint64(0xA5C3_1F0D_5EED_0001)
_DRAFT_SALT = np.uint64(0xD7AF_7E11_5EED_0002)


@dataclass
class Verified:
    accepted: np.ndarray  # [R] int64: drafts accepted
    tokens: np.ndarray  # [R, K + 1] int64: tokens[r, :accepted[r]] are drafts, tokens[r, accepted[r]] the new one


def draft_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Keys for a proposer's draw of the token at `positions` (independent of the target's and the test's)."""
    return draw_keys(np.asarray(seeds, dtype=np.uint64) ^ _DRAFT_SALT, positions)


def draw_from_probs(probs: torch.Tensor, keys: np.ndarray) -> np.ndarray:
    """One token per row of probs [R, V] (rows sum to 1, or to any positive mass), keyed like the sampler."""
    return draw_tokens(torch.log(probs.float()), keys)


def _uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[n] float64 in [0, 1): the acceptance test's draw at each position."""
    keys = draw_keys(np.asarray(seeds, dtype=np.uint64) ^ _ACCEPT_SALT, positions)
    return (keys >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def verify_drafts(p: torch.Tensor, q: torch.Tensor, drafts: np.ndarray, num_drafts: np.ndarray, seeds: np.ndarray,
                  positions: np.ndarray) -> Verified:
    """Accepted drafts and the token after them, per row (see the module docstring for the arguments)."""
    rows, k = drafts.shape
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    p, q = p.float(), q.float()
    accepted = np.zeros(rows, dtype=np.int64)
    if k:
        idx = torch.from_numpy(drafts.astype(np.int64))[:, :, None]
        p_x = p[:, :k].gather(2, idx)[:, :, 0].double().numpy()
        q_x = q.gather(2, idx)[:, :, 0].double().numpy()
        u = _uniforms(np.repeat(seeds, k), np.repeat(positions, k) + np.tile(np.arange(k), rows)).reshape(rows, k)
        # u < p/q without dividing: q(x) > 0 for a token drawn from q; p(x) >= q(x) always accepts (u < 1).
        ok = (u * q_x < p_x) & (np.arange(k)[None, :] < num_drafts[:, None])
        accepted = np.where(ok.all(axis=1), k, np.argmin(ok, axis=1)).astype(np.int64)
        accepted = np.minimum(accepted, num_drafts)
    r = torch.arange(rows)
    at = torch.from_numpy(accepted)
    weights = p[r, at].clone()
    rejected = accepted < num_drafts
    if rejected.any():
        rej = torch.from_numpy(np.flatnonzero(rejected))
        residual = (p[rej, at[rej]] - q[rej, at[rej]]).clamp_(min=0.0)
        # All mass gone only by rounding (p == q exactly never rejects): p without the rejected draft instead.
        empty = residual.sum(dim=1) <= 0
        if empty.any():
            fallback = p[rej[empty], at[rej[empty]]].clone()
            fallback[torch.arange(len(fallback)), torch.from_numpy(drafts[rejected, accepted[rejected]])[empty]] = 0.0
            residual[empty] = fallback
        weights[rej] = residual
    new = draw_from_probs(weights, draw_keys(np.asarray(seeds, dtype=np.uint64), positions + accepted))
    tokens = np.full((rows, k + 1), -1, dtype=np.int64)
    cols = np.arange(k)[None, :] < accepted[:, None]
    tokens[:, :k][cols] = drafts[cols]
    tokens[np.arange(rows), accepted] = new
    return Verified(accepted, tokens)
