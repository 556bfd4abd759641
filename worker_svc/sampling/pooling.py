"""Embeddings: a request's final hidden state (after the last norm), pooled over its prompt.

`--pooler-config` takes vLLM's JSON names: `pooling_type` LAST (the last prompt token, the default), MEAN (every
prompt token) or CLS (the first), and `normalize` (L2, default true). An embed request computes its prompt like
any prefill, in chunks where the token budget says so: MEAN sums each chunk's rows into a per-row accumulator and
CLS keeps the first position's; the vector comes back with the chunk that completes the prompt. The scheduler never
serves an embed request from the prefix cache (every position must be computed here) and ends it after that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.step_output import Pooled
from worker_svc.sampling.pooler_config import CLS, LAST, MEAN, PoolerConfig


@dataclass
class PoolRows:
    """This step's embed chunks: entry i is batch row rows[i]; `flat` the step rows whose hidden state is read
    (entry[j] says whose), `done` the entries whose chunk completes the prompt."""

    rows: np.ndarray
    starts: np.ndarray
    flat: np.ndarray
    entry: np.ndarray
    done: np.ndarray



class Pooler:
    def __init__(self, cfg: PoolerConfig):
        self.cfg = cfg
        self._partial: dict[int, torch.Tensor] = {}  # row -> MEAN's running sum / CLS's first state

    def select(self, s: Schedule, chunk_lengths: np.ndarray) -> PoolRows | None:
        b = s.inputs
        want = np.flatnonzero(b.embed[s.rows])
        if not len(want):
            return None
        rows, starts, lengths = s.rows[want], s.starts[want], s.lengths[want]
        prompt = b.num_prompt_tokens[rows]
        done = starts + lengths >= prompt
        offsets = (np.cumsum(chunk_lengths) - chunk_lengths)[want]
        if self.cfg.pooling_type == MEAN:
            n = np.minimum(starts + lengths, prompt) - starts
            entry = np.repeat(np.arange(len(rows)), n)
            flat = offsets[entry] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        elif self.cfg.pooling_type == CLS:
            entry = np.flatnonzero(starts == 0)
            flat = offsets[entry]
        else:
            entry = np.flatnonzero(done)
            flat = offsets[entry] + (prompt - 1 - starts)[entry]
        return PoolRows(rows, starts, flat, entry, done)

    def collect(self, hidden: torch.Tensor, sel: PoolRows, num_prompt_tokens: np.ndarray) -> Pooled:
        """`hidden`: the states of sel.flat's rows. Accumulates, and returns the vectors of the prompts done."""
        hidden = hidden.float()
        if self.cfg.pooling_type == LAST:
            vectors = hidden
        else:
            per_entry = torch.zeros(len(sel.rows), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            per_entry.index_add_(0, torch.from_numpy(sel.entry).to(hidden.device), hidden)
            parts = []
            for i, row in enumerate(sel.rows.tolist()):  # the few embed requests of this step
                acc = per_entry[i] if sel.starts[i] == 0 else self._partial.get(row, 0) + per_entry[i]
                if sel.done[i]:
                    self._partial.pop(row, None)
                    parts.append(acc / num_prompt_tokens[row] if self.cfg.pooling_type == MEAN else acc)
                else:
                    self._partial[row] = acc
            vectors = torch.stack(parts) if parts else hidden[:0]
        if self.cfg.normalize and len(vectors):
            vectors = F.normalize(vectors, p=2, dim=-1)
        return Pooled(sel.rows[sel.done], vectors.cpu().numpy())
