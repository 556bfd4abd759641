"""Torch reference of the paged-attention kernel interface; also the CPU production path.

The Triton kernels share these signatures, and the tests compare them with this file.

Speed matters here (the model calls `paged_attention` once per layer per step), so everything that
depends only on the batch shape -- which blocks to gather, which gathered rows to zero, the masks, how
padded rows map back to tokens -- is precomputed once per step in a `ReferencePlan`. A call then costs
two gathers and one `scaled_dot_product_attention` per group. Groups: prefill chunks (query_len > 1) and
decodes (query_len == 1) apart, each sorted by context length and cut where padding to the group's longest
member would exceed PADDING_LIMIT; decodes on CPU also in slices of at most `DECODE_GROUP_ROWS` gathered
rows, so each slice's gathered K/V is still in cache when attention reads it (measured ~30% faster than one
gather of every decode's context). The gathers write into two per-step buffers shared by all groups and
layers instead of fresh tensors (fresh multi-MB tensors come back from the allocator as untouched pages:
one page fault per 4 KiB, which cost as much as the gather itself). No Python loop over sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ops


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    """Store new keys/values at their slots. key/value: [num_tokens, Hkv, D]; slot -1 = skip (padding).

    key_cache/value_cache: [num_blocks, block_size, Hkv, D]; slot = block_id * block_size + offset.
    """
    if (key.device.type == "cpu" and key.dtype == value.dtype == key_cache.dtype and key.stride(1) == key.shape[2]
            and value.stride(1) == value.shape[2] and slot_mapping.dtype == torch.int64
            and (ops := cpu_ops.load()) is not None):
        ops.write_kv(key, value, key_cache, value_cache, slot_mapping)  # a row copy per token, slots < 0 skipped
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slot_mapping = slot_mapping.long()
    # view (not reshape): the write must land in the cache itself, never in a copy
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


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


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, *,
                    plan: ReferencePlan | None = None, out: Tensor | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """Attention of a mixed batch of decodes and prefill chunks over a paged KV cache.

    query: [num_tokens, Hq, D], the new tokens of all sequences concatenated; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1]. key_cache/value_cache: [num_blocks, block_size, Hkv, D].
    block_tables: [num_seqs, max_blocks] int32. seq_lens: [num_seqs], cached context + new tokens.
    GQA: query head h uses kv head h // (Hq // Hkv). Causal mask aligned bottom-right. Returns
    [num_tokens, Hq, D] in query's dtype (into `out` when given). Pass the step's `plan` to skip
    rebuilding it; without one it is computed here (a host sync).
    sliding_window: query at position p sees keys in (p - sliding_window, p]; None or <= 0 = off.
    softcap: scores become softcap * tanh(scale * q.k / softcap) (Gemma 2); None or 0 = off.
    sinks: [Hq] learned logits, one per query head (gpt-oss): each joins its head's softmax denominator as a
    key with no value, so out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m)), m the max over the
    visible scores and the sink. None = off.
    """
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    cap = softcap if softcap else None
    check_sinks(sinks, query.shape[1])
    if plan is None:
        cu = cu_seqlens_q.tolist()
        query_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        plan = build_reference_plan(block_tables, query_lens, seq_lens.tolist(), key_cache.shape[1],
                                    device=query.device)
    groups = plan.groups
    if plan.kernel_rows is not None and len(plan.kernel_rows.rows):
        out = _decode_kernel(plan.kernel_rows, query, key_cache, value_cache, scale, window, cap, sinks, out)
    if (out is None and len(groups) == 1 and plan.empty_rows is None and groups[0].real_pos is None
            and groups[0].span == (0, plan.num_tokens)):
        # One group covering every row in order (a lone prompt, or a few decodes): its result is the output.
        return _attend(groups[0], query, key_cache, value_cache, scale, plan.scratch, window, cap, sinks)
    if out is None:
        out = torch.empty_like(query)
    for g in groups:  # slices of decodes, then prefill chunks
        o = _attend(g, query, key_cache, value_cache, scale, plan.scratch, window, cap, sinks)
        if g.span is not None:
            out[g.span[0]:g.span[1]] = o
        else:
            out.index_copy_(0, g.rows, o)
    if plan.empty_rows is not None:
        out.index_fill_(0, plan.empty_rows, 0.0)
    return out


def _decode_kernel(d: _KernelRows, query: Tensor, key_cache: Tensor, value_cache: Tensor, scale: float,
                   window: int | None, cap: float | None, sinks: Tensor | None, out: Tensor | None) -> Tensor:
    """The kernel rows of `out` (made when None) by the C++ kernel: blocks read in place, float32 scores."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    q, o = query, out
    if key_cache.dtype not in (torch.float32, torch.bfloat16):  # float16 (not a CPU serving dtype): float32 copies
        key_cache, value_cache = key_cache.float(), value_cache.float()
    if query.dtype != key_cache.dtype:  # the kernel runs in the cache's dtype
        q, o = query.to(key_cache.dtype), torch.empty(query.shape, dtype=key_cache.dtype)
    cpu_ops.load().decode_attention(q, d.rows, key_cache, value_cache, d.tables, d.seq_lens, scale, window or 0,
                                    cap or 0.0, None if sinks is None else sinks.float().contiguous(), o)
    if o is not out:
        out.index_copy_(0, d.rows, o.index_select(0, d.rows).to(out.dtype))
    return out


def _window_mask(g: _Group, window: int | None, device: torch.device) -> tuple[Tensor | None, bool]:
    """(mask, is_causal) for the group's attention with a sliding window (None: the plain causal one). The
    window changes nothing when no query row sits `window` or more positions in."""
    if window is None or window > int(g.q_pos.max()):
        return g.mask, g.causal
    if window not in g.masks:
        t = np.arange(g.kv_len)[None, None]
        pos = g.q_pos[:, :, None]
        g.masks[window] = _to(((t <= pos) & (t > pos - window))[:, None], device)
    return g.masks[window], False


def check_sinks(sinks: Tensor | None, num_heads: int) -> None:
    """ValueError naming `sinks` unless it is None or one logit per query head."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape [num_heads] = ({num_heads},), got {tuple(sinks.shape)}")


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
                        cap: float | None, sinks: Tensor | None) -> Tensor:
    """SDPA with what SDPA cannot do: scores soft-capped before the mask, and sink logits in the softmax
    denominator. Scores computed whole (softmax in float32, as transformers' eager attention). q [B, Hq, M, D],
    k/v [B, Hkv, N, D], sinks [Hq]."""
    if k.shape[1] != q.shape[1]:  # GQA: query head h reads KV head h // (Hq // Hkv)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
    # The sink is one more column of the softmax whose weight is dropped: a row that sees no key gets zeros.
    sink = sinks.to(torch.float32).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s.float(), sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), v)


def _attend(g: _Group, query: Tensor, key_cache: Tensor, value_cache: Tensor, scale: float,
            scratch: list[Tensor | None], window: int | None = None, cap: float | None = None,
            sinks: Tensor | None = None) -> Tensor:
    """The group's output rows [len(g.rows), Hq, D], in the order of g.rows (a fresh tensor)."""
    num_heads, head_dim = query.shape[1:]
    if g.span is not None and g.real_pos is None:
        q = query[g.span[0]:g.span[1]]  # already in padded order: no copy
    else:
        q = query.index_select(0, g.q_index)
    k = _gather(key_cache, g, query.dtype, scratch, 0)
    v = _gather(value_cache, g, query.dtype, scratch, 1)
    num_kv_heads = k.shape[1]
    mask, causal = _window_mask(g, window, query.device)
    if cap is not None or sinks is not None:
        q = q.view(g.num_seqs, g.max_q, num_heads, head_dim).transpose(1, 2)
        o = _explicit_attention(q, k, v, mask, causal, scale, cap, sinks)
        o = o.transpose(1, 2).reshape(g.num_seqs * g.max_q, num_heads, head_dim)
        return o if g.real_pos is None else o.index_select(0, g.real_pos)
    # CPU SDPA handles the GQA broadcast and the strided K/V views without copies (measured faster
    # than grouped matmuls or .contiguous() K/V).
    if g.max_q == 1 and num_kv_heads != num_heads:
        # Decodes: a KV head's query heads become its query rows (nothing is causal within one token),
        # so each K/V row is read once per KV head instead of once per query head.
        q = q.view(g.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.reshape(g.num_seqs, num_heads, head_dim)
    else:
        q = q.view(g.num_seqs, g.max_q, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=num_kv_heads != num_heads)
        o = o.transpose(1, 2).reshape(g.num_seqs * g.max_q, num_heads, head_dim)
    if g.real_pos is not None:
        o = o.index_select(0, g.real_pos)
    return o


def _gather(cache: Tensor, g: _Group, dtype: torch.dtype, scratch: list[Tensor | None], slot: int) -> Tensor:
    """Each sequence's blocks as [num_seqs, Hkv, kv_len, D] (a strided view), zero past seq_len.

    The blocks land in `scratch[slot]` (grown as needed): the view is valid until the next gather there.
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    numel = len(g.blocks) * block_size * num_kv_heads * head_dim
    buf = scratch[slot]
    if buf is None or buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
        buf = scratch[slot] = cache.new_empty(numel)
    kv = buf[:numel].view(len(g.blocks), *cache.shape[1:])
    torch.index_select(cache, 0, g.blocks, out=kv)  # our own buffer: zeroing in place is safe
    if g.kv_pad is not None:
        kv.view(-1, num_kv_heads * head_dim).index_fill_(0, g.kv_pad, 0.0)
    kv = kv.view(g.num_seqs, g.num_blocks * block_size, num_kv_heads, head_dim)[:, :g.kv_len]
    return kv.to(dtype).transpose(1, 2)


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
