"""Structured outputs with speculation (any method): a constrained request drafts like any other, and its grammar
decides what may be verified.

Before the forward its drafts are cut before the first token the grammar rejects from its current state (or a stop
token), so no draft the grammar forbids can be accepted. At verification each of its 1 + d positions is masked at
the grammar's state after the drafts before it: position j samples exactly what step j of decoding without drafts
would, given drafts 1..j were accepted; greedy and seeded outputs stay those of decoding without drafts. After
verification the matcher advances over every emitted token (accepted drafts, then the bonus token); a grammar that
ends makes the request's last token a stop.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.core.input_batch import InputBatch
from worker_svc.core.ngram_drafts import Emitted
from worker_svc.core.step_output import FINISH_NONE, FINISH_STOP_TOKEN
from worker_svc.sampling.grammar import GrammarMasks


def cut(b: InputBatch, rows: np.ndarray, num_drafts: np.ndarray | None, stop_ids: frozenset[int]) -> None:
    """Cut each constrained chunk's drafts (written past its row's tokens) to the prefix its grammar accepts; in
    place."""
    if num_drafts is None:
        return
    for i in np.flatnonzero(b.constrained[rows] & (num_drafts > 0)).tolist():
        row, n = int(rows[i]), int(b.num_tokens[rows[i]])
        drafts = b.token_ids[row, n: n + int(num_drafts[i])].tolist()
        num_drafts[i] = GrammarMasks.fitting_prefix(b.matchers[row], drafts, stop_ids)


def mask_draft_logits(masks: GrammarMasks, logits: torch.Tensor, b: InputBatch, rows: np.ndarray,
                      stop_ids: list[int]) -> np.ndarray:
    """A draft model's next-draft logits of `rows` masked in place by each constrained row's grammar at its state
    (after the drafts so far) and without stop tokens, so that a sampled draft comes from a proposal q over tokens
    the grammar accepts (cutting a drawn draft instead would bias rejection sampling). False where a constrained
    row has no such token left: it drafts no further."""
    constrained = b.constrained[rows]
    fits = np.ones(len(rows), dtype=bool)
    if not constrained.any():
        return fits
    masks.apply(logits, [b.matchers[r] if c else None for r, c in zip(rows.tolist(), constrained.tolist(),
                                                                         strict=True)])
    idx = torch.from_numpy(np.flatnonzero(constrained))
    logits[idx[:, None], torch.tensor(stop_ids)[None, :]] = -float("inf")
    fits[constrained] = torch.isfinite(logits[idx].max(dim=-1).values).numpy()
    return fits


def follow_drafts(b: InputBatch, rows: np.ndarray, tokens: np.ndarray) -> None:
    """Advance the constrained rows' matchers over their new drafts (mask_draft_logits let only fitting ones be
    drawn); `rewind` takes them back."""
    for r, tok in zip(rows.tolist(), tokens.tolist(), strict=True):
        if b.constrained[r] and not b.matchers[r].accept_token(tok):
            raise AssertionError(f"draft {tok} does not fit its grammar after masking")


def rewind(b: InputBatch, rows: np.ndarray, num_drafts: np.ndarray) -> None:
    for r, d in zip(rows.tolist(), num_drafts.tolist(), strict=True):
        if b.constrained[r] and d:
            b.matchers[r].rollback(d)


def mask(masks: GrammarMasks, logits: torch.Tensor, b: InputBatch, rows: np.ndarray, virtual: np.ndarray,
         num_drafts: np.ndarray | None) -> None:
    """Mask the constrained rows' logits (one per verified position, in verified_positions order) in place."""
    if num_drafts is None:
        masks.apply(logits, [b.matchers[r] for r in virtual.tolist()])
        return
    starts = b.num_tokens[rows]
    drafts = [b.token_ids[r, n: n + d] for r, n, d in zip(rows.tolist(), starts.tolist(), num_drafts.tolist(),
                                                            strict=True)]
    masks.apply_with_drafts(logits, [b.matchers[r] for r in rows.tolist()], drafts)


def advance(masks: GrammarMasks, b: InputBatch, rows: np.ndarray, emitted: Emitted, with_drafts: bool) -> None:
    """Advance the constrained rows' matchers over the step's emitted tokens; where a grammar ended, its request's
    last token of the step finishes it as a stop (vLLM: finish_reason "stop")."""
    matchers = [b.matchers[r] for r in rows.tolist()]
    last = np.flatnonzero(np.diff(emitted.chunks, append=-1))  # each request's last token of the step
    if with_drafts:
        ended = masks.advance_runs(matchers, emitted.chunks, emitted.token_ids)[emitted.chunks[last]]
    else:  # one token per request: the batched advance
        ended = masks.advance(matchers, emitted.token_ids[last])
    ended &= emitted.reasons[last] == FINISH_NONE
    emitted.reasons[last[ended]] = FINISH_STOP_TOKEN
