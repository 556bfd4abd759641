"""Speculative decoding on the worker: n-gram (prompt lookup) drafts, and their verification.

Proposing: for each decoding row, the longest suffix of its tokens (prompt_lookup_max down to prompt_lookup_min
tokens) that occurred earlier in its prompt or output; the drafts are the tokens that followed its latest earlier
occurrence. A pure function of the row's tokens, vectorized over rows (one pass per suffix length over the
padded [rows, tokens] array), so a recomputed or resumed request proposes the same drafts.

Verifying: the drafts are extra query rows of the step's forward, and the sampler draws the target token at each of
the 1 + d positions exactly as it would without speculation (same logits context, same (seed, position) noise).
A draft is accepted while it equals the target token there; the first disagreeing target (or the one after the last
draft) is the bonus token. For greedy rows that is the argmax rule. For sampled rows it is rejection sampling with
a point-mass proposal q = delta(x): the target draw from p with the position's noise equals x with probability
p(x) (accept), and otherwise is distributed as p with x removed and renormalized (the residual (p - q)+ / Z); so
the text is the text speculation-off sampling gives, token for token, and stays a pure function of
(seed, position) across preemption, recompute and fail-over.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray, lookup_min: int,
                  lookup_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for rows of `token_ids` [R, W] (row r's tokens are token_ids[r, :num_tokens[r]]).

    Returns (drafts [R, max(max_drafts)] int64, counts [R] int64): row r proposes drafts[r, :counts[r]], at most
    max_drafts[r] tokens (0 where no suffix matched).
    """
    rows = len(num_tokens)
    width = int(max_drafts.max(initial=0))
    drafts = np.zeros((rows, width), dtype=np.int64)
    counts = np.zeros(rows, dtype=np.int64)
    if not rows or not width:
        return drafts, counts
    L = num_tokens.astype(np.int64)
    W = int(L.max())
    t = token_ids[:, :W].astype(np.int64)
    ends = np.arange(W)  # e: a candidate match ends right before position e, so t[e] is its first follower
    r = np.arange(rows)[:, None]
    # agree[r, e]: the m tokens before e equal row r's last m tokens (m grows one per pass); only ends inside the
    # known tokens (e <= L - 1: a follower exists).
    agree = ends[None, :] < L[:, None]
    best_end = np.full(rows, -1, dtype=np.int64)
    for m in range(1, lookup_max + 1):
        shifted = np.full((rows, W), -1, dtype=np.int64)
        shifted[:, m:] = t[:, : W - m]  # shifted[r, e] = t[r, e - m]
        last = t[r[:, 0], np.maximum(L - m, 0)]  # row r's m-th token from the end
        agree &= (shifted == last[:, None]) & (ends[None, :] >= m)
        agree[L < m + 1] = False  # the suffix itself must leave an earlier token to match
        if m >= lookup_min:
            hit = agree.any(axis=1)
            if not hit.any():
                break  # no longer suffix can match where this one does not
            # The latest earlier occurrence: the largest end (never the suffix itself: e <= L - 1).
            latest = W - 1 - np.argmax(agree[:, ::-1], axis=1)
            best_end = np.where(hit, latest, best_end)
    found = best_end >= 0
    counts = np.where(found, np.minimum(max_drafts, L - best_end), 0).astype(np.int64)
    cols = np.clip(best_end[:, None] + np.arange(width)[None, :], 0, W - 1)
    drafts = np.where(np.arange(width)[None, :] < counts[:, None], t[r, cols], 0)
    return drafts, counts


def accepted_lengths(targets: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """targets [R, 1 + D]: the token sampled at each verified position (column j follows drafts[:, :j]);
    drafts [R, D], counts [R]. Returns how many leading drafts of each row agree with the targets."""
    if not drafts.shape[1]:
        return np.zeros(len(counts), dtype=np.int64)
    d = drafts.shape[1]
    match = (targets[:, :d] == drafts) & (np.arange(d)[None, :] < counts[:, None])
    # The first disagreement (or the end of the drafts): argmin finds the first False; all True -> d.
    first_miss = np.where(match.all(axis=1), d, np.argmin(match, axis=1))
    return np.minimum(first_miss, counts).astype(np.int64)
