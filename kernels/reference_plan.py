"""The per-step plan of the torch paged-attention backend (`kernels.reference`): which rows go to the C++ decode
kernel, and for the rest which blocks each padded SDPA call gathers, which gathered rows are zeroed, the masks and how
padded rows map back to tokens -- everything that depends on the batch shape alone, computed once per step and shared
by the layers. Groups: prefill chunks (query_len > 1) and decodes (query_len == 1) apart, each sorted by context
length and cut where padding to the group's longest member would exceed PADDING_LIMIT; decodes on CPU also in slices
of at most `DECODE_GROUP_ROWS` gathered rows. No Python loop over sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kernels import cpu_ops


@dataclass
class _Group:
    """Sequences served by one padded attention call; every tensor is on the cache's device."""

    num_seqs: int
    max_q: int                      # padded query length (1 for decodes)
    kv_len: int                     # keys attended: the longest seq_len in the group
    num_blocks: int                 # blocks gathered per sequence: ceil(kv_len / block_size)
    blocks: Tensor                  # [num_seqs * num_blocks] int64; entries past a sequence's end -> 0
    kv_pad: Tensor | None           # flat gathered rows at/after seq_len: zeroed, they may hold NaN
    mask: Tensor | None             # [num_seqs, 1, max_q, kv_len] bool, True = attend; None = see causal
    causal: bool                    # mask is None because it is SDPA's is_causal (no cached context, no padding)
    q_index: Tensor                 # [num_seqs * max_q] query rows; padded rows repeat the first token
    real_pos: Tensor | None         # positions of real rows among the padded ones; None = no padding
    rows: Tensor                    # [num_real] token rows the real positions are written to
    span: tuple[int, int] | None    # rows == range(*span): slice instead of gather/scatter
    q_pos: np.ndarray               # [num_seqs, max_q] absolute position of each (padded) query row
    # Explicit masks by sliding window (None: none), made on first use by a layer that needs one.
    masks: dict = field(default_factory=dict, repr=False)


# Decodes are gathered and attended in slices of at most this many gathered rows (a whole number of
# sequences, at least one); ~3 MB of fp32 K+V for SmolLM2's 3 x 64 heads. CPU only: on CUDA more groups
# would only mean more kernel launches.
DECODE_GROUP_ROWS = 4096


@dataclass
class _KernelRows:
    """Query rows for the C++ kernel (kernels/cpu_ops.py), which reads their blocks in place: every decode, and
    the rows of short prefill chunks."""

    rows: Tensor                    # [n] int64 token rows
    tables: Tensor                  # [n, blocks] int32: each row's sequence's block table
    seq_lens: Tensor                # [n] int32: positions each row sees (its own included)


@dataclass
class ReferencePlan:
    """Everything `paged_attention` needs besides the tensors; built once per step, shared by layers."""

    num_tokens: int
    groups: list[_Group]
    empty_rows: Tensor | None       # rows that see no key (query_len > seq_len): output zeros
    kernel_rows: _KernelRows | None = None  # rows for the C++ kernel; None: decodes are in `groups`
    # Gather buffers for K and V (flat), made by the first call and reused by every group and layer.
    scratch: list[Tensor | None] = field(default_factory=lambda: [None, None], repr=False)


def build_reference_plan(block_tables: Tensor | np.ndarray, query_lens: Sequence[int] | np.ndarray,
                         seq_lens: Sequence[int] | np.ndarray, block_size: int,
                         device: torch.device | str | None = None, decode_kernel: bool | None = None) -> ReferencePlan:
    """Precompute gather indices and masks; see `paged_attention` for the meaning of the arguments.

    Built with numpy on the host (a numpy call costs about a microsecond, a torch one several), then moved to
    `device` (default: block_tables' device, CPU for an array). decode_kernel: the decodes (and short prefill
    chunks) go to the C++ kernel instead of gathered SDPA groups (None: on CPU where it is built).
    """
    if isinstance(block_tables, Tensor):
        device = block_tables.device if device is None else device
        tables = block_tables.to("cpu", torch.int64).numpy()
    else:
        tables = np.asarray(block_tables, dtype=np.int64)
    device = torch.device("cpu" if device is None else device)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    starts = np.cumsum(q) - q
    if decode_kernel is None:
        decode_kernel = device.type == "cpu" and cpu_ops.load() is not None
    plan_rows = None
    if decode_kernel:
        # Decodes, and prefill chunks of short contexts, row by row: each query row sees its own prefix.
        seqs = np.flatnonzero((q == 1) | ((q > 1) & (s <= KERNEL_PREFILL_MAX_CONTEXT)))
        plan_rows = _kernel_rows(seqs, q, s, starts, tables, block_size)
        groups, empty = [], []
        prefills = np.flatnonzero((q > 1) & (s > KERNEL_PREFILL_MAX_CONTEXT))
    else:
        # On CPU, slices small enough for a slice's gathered K/V to stay in cache; on CUDA, fewer launches.
        max_rows = DECODE_GROUP_ROWS if device.type == "cpu" else float("inf")
        order, ends = _split_decodes(np.flatnonzero(q == 1), s, block_size, max_rows)
        groups, empty = _build_decode_groups(order, ends, tables, starts, s, block_size, device)
        prefills = np.flatnonzero(q > 1)
    for ids in _split_prefills(prefills, q, s):
        group, group_empty = _build_group(ids, tables, starts, q, s, block_size, device)
        groups.append(group)
        empty.append(group_empty)
    empty_rows = np.concatenate(empty) if empty else np.zeros(0, dtype=np.int64)
    return ReferencePlan(
        num_tokens=int(q.sum()),
        groups=groups,
        empty_rows=_to(empty_rows, device) if len(empty_rows) else None,
        kernel_rows=plan_rows,
    )


# Prefill chunks whose sequences are at most this long go to the C++ kernel row by row (like decodes) instead of
# SDPA over gathered blocks: measured faster up to here (kernels/README.md); its work grows with
# query rows x context, SDPA's matmuls run that at a higher rate, so long prompts stay with SDPA.
KERNEL_PREFILL_MAX_CONTEXT = 256


def _kernel_rows(seqs: np.ndarray, q: np.ndarray, s: np.ndarray, starts: np.ndarray, tables: np.ndarray,
                 block_size: int) -> _KernelRows:
    """One kernel row per query token of `seqs`: its token row, its sequence's block table, and the context it sees
    (a chunk's row j of query_len n at seq_len L sees L - n + 1 + j positions)."""
    counts = q[seqs]
    seq_of_row = np.repeat(seqs, counts)
    offset = np.arange(len(seq_of_row)) - np.repeat(np.cumsum(counts) - counts, counts)
    lens = s[seq_of_row] - q[seq_of_row] + 1 + offset
    cols = max(1, -(-int(lens.max(initial=0)) // block_size))
    return _KernelRows(rows=torch.from_numpy(starts[seq_of_row] + offset),
                    tables=torch.from_numpy(np.ascontiguousarray(tables[seq_of_row, :cols], dtype=np.int32)),
                    seq_lens=torch.from_numpy(np.maximum(lens, 0).astype(np.int32)))


def _split_decodes(decodes: np.ndarray, seq_lens: np.ndarray, block_size: int,
                   max_rows: float) -> tuple[np.ndarray, list[int]]:
    """Decodes by increasing context, in groups of at most `max_rows` gathered rows where possible (a sequence is
    never split) whose padding to the group's longest context stays within PADDING_LIMIT: one 2k-token context
    among 200-token ones would otherwise make every member of its group gather and attend 2k rows.

    Returns the decodes sorted by context and where each group ends in that order. Greedy, like a loop that adds
    each decode to the last group while both bounds hold; vectorized per group: for each later decode j (the
    group's longest, as they are sorted), whether first .. j would still be within bounds.
    """
    order = decodes[np.argsort(seq_lens[decodes], kind="stable")]
    rows = np.maximum(1, -(-seq_lens[order] // block_size)) * block_size
    ends: list[int] = []
    first, n = 0, len(order)
    while first < n:
        # Each member gathers at least rows[first] rows: no group outgrows max_rows // rows[first] members.
        last = n if max_rows == float("inf") else min(n, first + max(1, int(max_rows // rows[first])))
        members = np.arange(2, last - first + 1)  # group size if it ran up to decode first + members - 1
        padded = members * rows[first + 1:last]
        real = np.cumsum(rows[first:last])[1:]
        fits = (padded <= max_rows) & (padded <= PADDING_LIMIT * real)
        first += 1 + (int(np.argmin(fits)) if not fits.all() else len(fits))
        ends.append(first)
    return order, ends


def _build_decode_groups(order: np.ndarray, ends: list[int], tables: np.ndarray, starts: np.ndarray,
                         seq_lens: np.ndarray, block_size: int, device: torch.device) -> tuple[list[_Group], list]:
    """The decode groups (consecutive runs of `order`, by increasing context): what `_build_group` computes for
    query length 1, with the per-decode arrays gathered once for all groups. A decode's one query row sits at
    seq_len - 1 and sees its whole sequence, so the mask is the length mask and the query rows are the tokens."""
    k, start = seq_lens[order], starts[order]
    used = (k + block_size - 1) // block_size
    sorted_tables = tables[order]
    groups: list[_Group] = []
    for a, b in zip([0, *ends], ends, strict=False):  # consecutive (start, end) pairs
        kv_len = max(1, int(k[b - 1]))
        num_blocks = max(1, -(-kv_len // block_size))
        if tables.shape[1] < num_blocks:
            raise ValueError(f"block_tables has {tables.shape[1]} columns, a sequence of {kv_len} tokens "
                             f"needs {num_blocks} blocks of {block_size}")
        # Entries past a sequence's last block may be garbage or -1: never index with them.
        blocks = np.where(np.arange(num_blocks) < used[a:b, None], sorted_tables[a:b, :num_blocks], 0)
        kv_pad = mask = None
        if k[a] != kv_len:  # not all of one length (the shortest is first): zero and mask past each seq_len
            in_seq = np.arange(kv_len) < k[a:b, None]
            seq, pos_k = np.nonzero(~in_seq)
            kv_pad = _to(seq * (num_blocks * block_size) + pos_k, device)
            mask = _to(in_seq[:, None, None], device)
        rows = start[a:b]
        rows_t = _to(rows, device)
        groups.append(_Group(
            num_seqs=b - a, max_q=1, kv_len=kv_len, num_blocks=num_blocks, blocks=_to(blocks.ravel(), device),
            kv_pad=kv_pad, mask=mask, causal=False, q_index=rows_t, real_pos=None, rows=rows_t,
            span=(int(rows[0]), int(rows[0]) + b - a) if bool((np.diff(rows) == 1).all()) else None,
            q_pos=(k[a:b] - 1)[:, None],
        ))
    return groups, [start[k < 1]]  # rows that see no key: a decode of an empty sequence (invalid input)


# A group pads every member to its longest query and context; a sequence joins only while the padded work stays
# within this factor of the real work (one 4k-token prompt padded with sixty 100-token ones would otherwise cost
# 60 x 4k x 4k attention scores).
PADDING_LIMIT = 1.25


def _split_prefills(prefills: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """Prefill chunks in groups of similar shape, by increasing context length (a loop: a step has few chunks)."""
    order = prefills[np.lexsort((query_lens[prefills], seq_lens[prefills]))]
    groups: list[list[int]] = []
    real = max_q = 0
    for i, q, s in zip(order.tolist(), query_lens[order].tolist(), seq_lens[order].tolist(), strict=True):
        if groups:
            # sorted by context: this one has the group's longest (max_q is the longest query so far)
            padded = (len(groups[-1]) + 1) * max(max_q, q) * s
            if padded <= PADDING_LIMIT * (real + q * s):
                groups[-1].append(i)
                real += q * s
                max_q = max(max_q, q)
                continue
        groups.append([i])
        real, max_q = q * s, q
    return [np.array(g, dtype=np.int64) for g in groups]


def _build_group(ids: np.ndarray, tables: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                 seq_lens: np.ndarray, block_size: int, device: torch.device) -> tuple[_Group, np.ndarray]:
    q, k, start = query_lens[ids], seq_lens[ids], starts[ids]
    num_seqs, max_q, kv_len = len(ids), int(q.max()), max(1, int(k.max()))
    num_blocks = max(1, -(-kv_len // block_size))
    if tables.shape[1] < num_blocks:
        raise ValueError(f"block_tables has {tables.shape[1]} columns, a sequence of {kv_len} tokens "
                         f"needs {num_blocks} blocks of {block_size}")

    # Entries past a sequence's last block may be garbage or -1: never index with them.
    used = (k + block_size - 1) // block_size
    blocks = np.where(np.arange(num_blocks) < used[:, None], tables[ids, :num_blocks], 0)

    # Gathered rows at/after seq_len are unwritten (maybe NaN): zero them, masking scores is not enough
    # because softmax weight 0 * NaN = NaN.
    t = np.arange(kv_len)
    seq, pos_k = np.nonzero(t[None] >= k[:, None])
    kv_pad = seq * (num_blocks * block_size) + pos_k

    # Bottom-right causal: query row j sits at absolute position seq_len - query_len + j. Padded rows
    # copy the last real row so they are never fully masked; their output is dropped.
    j = np.arange(max_q)
    real = j[None] < q[:, None]
    q_pos = np.where(real, (k - q)[:, None] + j, (k - 1)[:, None])
    mask = t[None, None] <= q_pos[:, :, None]  # implies t < seq_len, so no separate length mask
    token = start[:, None] + j
    rows = token[real]
    q_index = np.where(real, token, start[:, None]).ravel()
    empty_rows = token[real & (q_pos < 0)]
    all_real = bool(real.all())
    # Whole prompts of one length: the mask is plain causal, which SDPA skips blocks for.
    causal = max_q > 1 and all_real and bool(np.array_equal(q, k))
    first = int(rows[0])
    group = _Group(
        num_seqs=num_seqs,
        max_q=max_q,
        kv_len=kv_len,
        num_blocks=num_blocks,
        blocks=_to(blocks.ravel(), device),
        kv_pad=_to(kv_pad, device) if len(kv_pad) else None,
        mask=None if causal or bool(mask.all()) else _to(mask[:, None], device),
        causal=causal,
        q_index=_to(q_index, device),
        real_pos=None if all_real else _to(np.flatnonzero(real), device),
        rows=_to(rows, device),
        span=(first, first + len(rows)) if bool((np.diff(rows) == 1).all()) else None,  # rows == first, first + 1..
        q_pos=q_pos,
    )
    return group, empty_rows


def _to(a: np.ndarray, device: torch.device) -> Tensor:
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)
