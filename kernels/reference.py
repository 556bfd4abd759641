"""Torch reference of the paged-attention kernel interface; also the CPU production path.

The Triton kernels share these signatures, and the tests compare them with this file.

Speed matters here (the model calls `paged_attention` once per layer per step), so everything that
depends only on the batch shape -- which blocks to gather, which gathered rows to zero, the masks, how
padded rows map back to tokens -- is precomputed once per step in a `ReferencePlan` (`kernels.reference_plan`;
the step's metadata is `kernels.attention_metadata`, both importable from here too). A call then costs
two gathers and one `scaled_dot_product_attention` per group. Groups: prefill chunks (query_len > 1) and
decodes (query_len == 1) apart, each sorted by context length and cut where padding to the group's longest
member would exceed PADDING_LIMIT; decodes on CPU also in slices of at most `DECODE_GROUP_ROWS` gathered
rows, so each slice's gathered K/V is still in cache when attention reads it (measured ~30% faster than one
gather of every decode's context). The gathers write into two per-step buffers shared by all groups and
layers instead of fresh tensors (fresh multi-MB tensors come back from the allocator as untouched pages:
one page fault per 4 KiB, which cost as much as the gather itself). No Python loop over sequences.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ops
from kernels.attention_metadata import AttentionMetadata, attention_metadata_from_arrays, build_attention_metadata
from kernels.reference_plan import (
    DECODE_GROUP_ROWS,
    KERNEL_PREFILL_MAX_CONTEXT,
    PADDING_LIMIT,
    ReferencePlan,
    _Group,
    _KernelRows,
    _to,
    build_reference_plan,
)

__all__ = [  # the plan's and the metadata's names too, where callers import them from
    "DECODE_GROUP_ROWS",
    "KERNEL_PREFILL_MAX_CONTEXT",
    "PADDING_LIMIT",
    "AttentionMetadata",
    "ReferencePlan",
    "attention_metadata_from_arrays",
    "build_attention_metadata",
    "build_reference_plan",
    "check_sinks",
    "paged_attention",
    "write_kv_cache",
]


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
