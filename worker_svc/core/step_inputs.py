"""The flattened model inputs of one step, gathered from the persistent batch with array operations.

Chunk i (row rows[i]) computes positions starts[i] .. starts[i] + lengths[i] - 1; the chunks are laid end to
end, so token t belongs to chunk seq[t] = repeat(arange(n), lengths)[t]. No Python loop over chunks or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels
from worker_svc.core.persistent_batch import Schedule


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: kernels.AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of each chunk that reaches its end
    sample_rows: np.ndarray  # [num_sampled] int64: the batch rows those chunks belong to
    # Speculative decoding: drafts each sampling chunk verifies (its logits are its last 1 + drafts positions, and
    # the drafts were written to the batch's token_ids past num_tokens); None when no chunk has any.
    num_drafts: np.ndarray | None = None
    # Embeddings: rows whose final normed hidden state the step reads (worker_svc/sampling/pooling.py); None: none.
    pool_indices: torch.Tensor | None = None
    # Hybrid models: the state pool and each chunk's slot (worker_svc/state_cache.StateStep), set by the runner.
    state: Any = None


def build_model_inputs(s: Schedule, block_size: int, device: torch.device, *, build_plan: bool,
                       num_drafts: np.ndarray | None = None) -> ModelInputs:
    """`num_drafts` (parallel to s.rows): draft tokens appended as query rows after each chunk."""
    b = s.inputs
    lengths = s.lengths if num_drafts is None else s.lengths + num_drafts
    ends = np.cumsum(lengths)
    seq = np.repeat(np.arange(len(s.rows)), lengths)
    positions = np.arange(len(seq)) + (s.starts - ends + lengths)[seq]
    input_ids = b.token_ids[s.rows[seq], positions].astype(np.int64)
    seq_lens = s.starts + lengths
    samples = s.starts + s.lengths == b.num_tokens[s.rows]
    num_blocks = b.num_blocks[s.rows]
    # As wide as the longest table, 0 past each one's blocks (the kernels' layout).
    tables = b.block_table[s.rows, : max(1, int(num_blocks.max(initial=0)))]
    meta = kernels.attention_metadata_from_arrays(lengths, seq_lens, tables, block_size, device,
                                                  build_plan=build_plan)
    if num_drafts is None:
        logits_indices, drafts = ends[samples] - 1, None
    else:
        drafts = num_drafts[samples]
        per = drafts + 1  # logits of the chunk's last token and of each draft
        first = np.cumsum(per) - per
        logits_indices = np.repeat(ends[samples] - per, per) + np.arange(int(per.sum())) - np.repeat(first, per)
    return ModelInputs(
        input_ids=_to(input_ids, device),
        positions=_to(positions, device),
        attn_metadata=meta,
        logits_indices=_to(logits_indices, device),
        sample_rows=s.rows[samples],
        num_drafts=drafts,
    )


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)
