"""The attention metadata of one model step (slots, block tables, sequence lengths), shared by every layer and by
both attention backends; with the torch backend's plan (`kernels.reference_plan`) when asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.reference_plan import ReferencePlan, _to, build_reference_plan


@dataclass
class AttentionMetadata:
    """Built once per model step and shared by all layers."""

    slot_mapping: Tensor            # [num_tokens] int64 cache slot of each new token
    block_tables: Tensor            # [num_seqs, max_blocks] int32, padded with 0
    cu_seqlens_q: Tensor            # [num_seqs + 1] int32
    seq_lens: Tensor                # [num_seqs] int32, cached context + new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    plan: ReferencePlan | None = None  # for the reference backend; None for kernels that need none


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str, *,
                             build_plan: bool = True) -> AttentionMetadata:
    """Metadata for one step. The new tokens of sequence i are its last query_lens[i] positions."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(f"{len(query_lens)} query_lens, {len(seq_lens)} seq_lens and "
                         f"{len(block_tables)} block tables: need one of each per sequence")
    for i, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 <= q <= s:
            raise ValueError(f"sequence {i}: query_len {q} must be in [0, seq_len {s}]")
        if len(table) * block_size < s:
            raise ValueError(f"sequence {i}: {len(table)} blocks of {block_size} cannot hold seq_len {s}")

    max_blocks = max((len(t) for t in block_tables), default=0) or 1
    tables = np.zeros((len(block_tables), max_blocks), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    return attention_metadata_from_arrays(np.asarray(query_lens, dtype=np.int64).reshape(-1),
                                          np.asarray(seq_lens, dtype=np.int64).reshape(-1), tables, block_size,
                                          device, build_plan=build_plan)


def attention_metadata_from_arrays(query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                                   block_size: int, device: torch.device | str, *,
                                   build_plan: bool = True) -> AttentionMetadata:
    """`build_attention_metadata` from int64 arrays, unchecked: the caller (the worker's persistent batch) has
    validated them. block_tables: [num_seqs, max_blocks] int64, 0 past each sequence's blocks. No Python loop
    over sequences or tokens."""
    num_seqs = len(query_lens)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    seq = np.repeat(np.arange(num_seqs), query_lens)
    pos = (seq_lens - query_lens)[seq] + np.arange(cu[-1]) - cu[seq]
    slot_mapping = block_tables[seq, pos // block_size] * block_size + pos % block_size

    device = torch.device(device)
    return AttentionMetadata(
        slot_mapping=_to(slot_mapping, device),
        block_tables=_to(block_tables.astype(np.int32), device),
        cu_seqlens_q=_to(cu.astype(np.int32), device),
        seq_lens=_to(seq_lens.astype(np.int32), device),
        max_seqlen_q=int(query_lens.max()) if num_seqs else 0,
        max_seqlen_k=int(seq_lens.max()) if num_seqs else 0,
        block_size=block_size,
        plan=build_reference_plan(block_tables, query_lens, seq_lens, block_size, device) if build_plan else None,
    )
