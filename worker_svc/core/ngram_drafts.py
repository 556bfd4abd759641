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

from dataclasses import dataclass

import numpy as np

from worker_svc.core.input_batch import InputBatch


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


def draft_caps(b: InputBatch, rows: np.ndarray, ends: np.ndarray, draft_slots: np.ndarray, block_size: int,
               max_model_len: int) -> np.ndarray:
    """How many drafts each chunk may verify, for any proposer: within the grant, the row's blocks, max_model_len
    (the bonus token included) and max_tokens; 0 for chunks that do not reach the row's end. A grammar row's
    drafts are cut to what its grammar accepts after they are made (grammar_drafts.cut)."""
    n = b.num_tokens[rows]
    cap = np.minimum(draft_slots, b.num_blocks[rows] * block_size - ends)
    cap = np.minimum(cap, max_model_len - 1 - n)
    max_tokens = b.max_tokens[rows]
    cap = np.where(max_tokens > 0, np.minimum(cap, max_tokens - (n - b.num_prompt_tokens[rows]) - 1), cap)
    cap = np.where(ends == n, np.maximum(cap, 0), 0)
    return cap


def propose(b: InputBatch, rows: np.ndarray, ends: np.ndarray, draft_slots: np.ndarray, block_size: int,
            max_model_len: int, lookup_min: int, lookup_max: int) -> np.ndarray:
    """N-gram drafts for the chunks (rows[i], computing up to ends[i]) that decode and were granted draft slots,
    written to the batch's token_ids past each row's num_tokens (the next step's tokens overwrite them); returns
    the drafts per chunk (0 for most)."""
    n = b.num_tokens[rows]
    cap = draft_caps(b, rows, ends, draft_slots, block_size, max_model_len)
    num_drafts = np.zeros(len(rows), dtype=np.int64)
    which = np.flatnonzero(cap > 0)
    if not len(which):
        return num_drafts
    spec_rows = rows[which]
    drafts, counts = propose_ngram(b.token_ids[spec_rows], n[which], cap[which], lookup_min, lookup_max)
    b.reserve_tokens(int((n[which] + counts).max()))
    col = np.arange(drafts.shape[1])
    r, c = np.nonzero(col[None, :] < counts[:, None])
    b.token_ids[spec_rows[r], n[which][r] + c] = drafts[r, c]
    num_drafts[which] = counts
    return num_drafts


def verified_positions(rows: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's rows for verification: row rows[i] once per position it samples (1 + num_drafts[i]), and
    each position's offset past the row's num_tokens (its draft tokens before it)."""
    per = num_drafts + 1
    first = np.cumsum(per) - per
    return np.repeat(rows, per), np.arange(int(per.sum())) - np.repeat(first, per)


@dataclass
class Emitted:
    """The tokens a step appended, in entry order (a request's tokens together, in order)."""

    chunks: np.ndarray  # per entry: its index in the step's sampling rows
    token_ids: np.ndarray
    reasons: np.ndarray  # per entry: FINISH_*; a nonzero one is the row's last entry
    entry_of: np.ndarray  # per sampled position: the entry it became, -1 where a finish cut the run before it
    accepted: np.ndarray  # per row: drafts accepted


def emit_one_each(b: InputBatch, rows: np.ndarray, tokens: np.ndarray, eos_token_ids: np.ndarray) -> Emitted:
    """Plain sampling (no drafts): one token per row."""
    b.append_tokens(rows, tokens)
    one = np.arange(len(rows))
    return Emitted(one, tokens, b.finish_reasons(rows, eos_token_ids), one, np.zeros(len(rows), dtype=np.int64))


def verify(b: InputBatch, rows: np.ndarray, num_drafts: np.ndarray, sampled: np.ndarray,
           eos_token_ids: np.ndarray) -> Emitted:
    """Accept the leading drafts of each row that equal the tokens sampled before them (`sampled`: one per
    verified position, in verified_positions order), then append those and the bonus token position by position
    (EOS, a stop token or a length limit ends a row's run there)."""
    per = num_drafts + 1
    first = np.cumsum(per) - per
    width = int(per.max())
    targets = np.full((len(rows), width), -1, dtype=np.int64)
    targets[np.repeat(np.arange(len(rows)), per), np.arange(int(per.sum())) - np.repeat(first, per)] = sampled
    drafts = np.zeros((len(rows), width - 1), dtype=np.int64)
    r, c = np.nonzero(np.arange(width - 1)[None, :] < num_drafts[:, None])
    drafts[r, c] = b.token_ids[rows[r], b.num_tokens[rows][r] + c]
    accepted = accepted_lengths(targets, drafts, num_drafts)
    # Emit position by position (a few columns, not a loop over requests); a finish stops the row.
    alive = np.ones(len(rows), dtype=bool)
    emitted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (chunk index, column, reason)
    for j in range(int(accepted.max()) + 1):
        idx = np.flatnonzero(alive & (accepted >= j))
        if not len(idx):
            break
        b.append_tokens(rows[idx], targets[idx, j])
        reasons = b.finish_reasons(rows[idx], eos_token_ids)
        emitted.append((idx, np.full(len(idx), j), reasons))
        alive[idx[reasons != 0]] = False
    chunk = np.concatenate([e[0] for e in emitted])
    column = np.concatenate([e[1] for e in emitted])
    reasons = np.concatenate([e[2] for e in emitted])
    order = np.lexsort((column, chunk))  # each request's tokens together, in order
    chunk, column, reasons = chunk[order], column[order], reasons[order]
    entry_of = np.full(int(per.sum()), -1, dtype=np.int64)
    entry_of[first[chunk] + column] = np.arange(len(chunk))
    return Emitted(chunk, targets[chunk, column], reasons, entry_of, accepted)
