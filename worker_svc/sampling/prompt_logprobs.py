"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability under the model, from the same
prefill forward that computes the prompt's KV.

A chunk computing positions [start, start + length) of a request that asked has the logits of each of those
positions for the token after it: position p scores prompt token p + 1. Those rows join the step's
`logits_indices` after the sampling rows; the last prompt position is the sampling row itself (it predicts the
first output token), so a chunk scores tokens start + 1 .. min(start + length, num_prompt - 1). With chunked
prefill each chunk returns its own tokens. The scheduler never serves such a request from the prefix cache, so
every prompt position is computed and scored (scheduler_svc/core/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.step_output import PromptLogprobs


def _ints() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _floats() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass
class PromptRows:
    """The step's rows that score prompt tokens: entry i (batch row rows[i]) scores counts[i] tokens from prompt
    position starts[i] on; per scored token, its row in the flattened step (`flat`), the token, its top count."""

    rows: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    entry_top: np.ndarray  # per entry: the request's prompt_logprobs
    flat: np.ndarray
    targets: np.ndarray
    num_top: np.ndarray  # per scored token



def select(s: Schedule, chunk_lengths: np.ndarray) -> PromptRows | None:
    """The rows of this step that score prompt tokens (None: no chunk does). `chunk_lengths`: each chunk's rows in
    the flattened step (its tokens plus any draft rows), as the model inputs lay them out."""
    b = s.inputs
    k = b.prompt_logprobs[s.rows]
    want = np.flatnonzero(k >= 0)
    if not len(want):
        return None
    rows, starts = s.rows[want], s.starts[want]
    last = b.num_prompt_tokens[rows] - 1  # the last prompt position: it samples, it scores nothing in the prompt
    counts = np.maximum(np.minimum(starts + s.lengths[want], last) - starts, 0)
    keep = counts > 0
    if not keep.any():
        return None
    rows, starts, counts, want = rows[keep], starts[keep], counts[keep], want[keep]
    offsets = (np.cumsum(chunk_lengths) - chunk_lengths)[want]  # each chunk's first row in the step
    entry = np.repeat(np.arange(len(rows)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = starts[entry] + within
    return PromptRows(rows=rows, starts=starts + 1, counts=counts, entry_top=k[want], flat=offsets[entry] + within,
                      targets=b.token_ids[rows[entry], positions + 1].astype(np.int64),
                      num_top=np.repeat(k[want], counts))


def score(logits: torch.Tensor, sel: PromptRows) -> PromptLogprobs:
    """Log-softmax of the scoring rows' logits (float32): each scored token's logprob and its top ones."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values = lp.gather(1, torch.from_numpy(sel.targets).to(lp.device)[:, None]).squeeze(1)
    out = PromptLogprobs(slots=sel.rows, starts=sel.starts, counts=sel.counts, num_top=sel.entry_top,
                         values=values.cpu().numpy())
    k = int(sel.num_top.max())
    if k:
        top_values, top_ids = lp.topk(k, dim=-1)
        mask = np.arange(k)[None, :] < sel.num_top[:, None]  # each token keeps its request's count, row-major
        out.top_token_ids = top_ids.cpu().numpy()[mask]
        out.top_values = top_values.cpu().numpy()[mask]
    return out
