"""Triton paged-attention kernels: same interface as `kernels.reference`, one launch per mixed batch.

`write_kv_cache` stores each new token's K/V at its slot. `paged_attention` runs the whole step --
decodes and prefill chunks of any length -- in one launch over a grid of (query tile, KV head, split):

- **Query tiles, varlen without a host sync.** Sequence i owns grid slots starting at
  `cu_seqlens_q[i] // BLOCK_Q + i`; that is strictly increasing in i and leaves at least
  ceil(q_len / BLOCK_Q) slots per sequence, so the grid `num_tokens // BLOCK_Q + num_seqs` covers every
  tile. A program finds its sequence by binary search over `cu_seqlens_q`; spare slots exit at once.
- **GQA packing.** The G = Hq / Hkv query heads sharing a KV head are packed into the rows of one tile:
  row r is (token r // G_PAD, head r % G_PAD), G padded to a power of two. A decode token of a 32/8-head
  model fills 4 of 16 rows, so the dots still have M >= 16 and K/V is read once for the whole group.
- **KV tiles independent of the block size.** Each key position looks up its own block-table entry
  (`n // block_size`), so a tile may span several blocks or part of one.
- **Bottom-right causal mask.** Query j of a sequence with q_len new tokens sits at absolute position
  `seq_len - q_len + j` and sees keys at positions <= its own (and > pos - sliding_window with a window).
  Tiles that every row sees whole are run without masks; only the diagonal (and window edge) tiles
  build the mask, and they also mask the block-table and K/V loads past `seq_len` (slots there may
  hold NaN, and 0 * NaN = NaN). Rows that see no key output zeros.
- **Split-KV (flash-decoding).** With `num_splits` > 1 the KV range of each tile is cut into that many
  contiguous runs of tiles, each program writes a normalised partial output and its log-sum-exp, and
  `_merge_kernel` combines them. Splits with no tile (more splits than tiles) write LSE = -inf.
- **Precision.** Under `TRITON_INTERPRET=1` everything is loaded then converted to float32 (bf16
  arithmetic is broken in the interpreter, and its fp32 -> bf16 cast truncates, so bf16 results are
  rounded to nearest even by hand). On GPU, the dots take the input dtype with float32 accumulation;
  float32 inputs use IEEE (not TF32) dots.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
from torch import Tensor

from kernels.reference import check_sinks
from kernels.triton_attention_kernels import (  # the device code, reachable from here (the sm_90a compile test)
    _merge_kernel,
    _paged_attention_kernel,
    _write_kv_kernel,
)

__all__ = ["INTERPRET", "paged_attention", "write_kv_cache", "choose_num_splits", "kernel_config"]


def _interpret() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# `triton.jit` picks the interpreter when the decorator runs, i.e. when this module is imported.
INTERPRET = _interpret()

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


# ------------------------------------------------------------------------------------ write_kv_cache


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    """Store new keys/values at their slots. key/value: [num_tokens, Hkv, D]; slot -1 = skip (padding).

    key_cache/value_cache: [num_blocks, block_size, Hkv, D]; slot = block_id * block_size + offset,
    computed in int64. Values are converted to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_last_dim(key, value, key_cache, value_cache)
    block_size = key_cache.shape[1]
    convert = key.dtype != key_cache.dtype or value.dtype != value_cache.dtype
    rtne = INTERPRET and convert and key_cache.dtype == torch.bfloat16
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), CONVERT=convert, RTNE_BF16=rtne,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )



@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_config(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  *, tile_q: int | None = None, tile_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> dict[str, int]:
    """Tile shape and launch options from tensor shapes only (no host sync).

    Rows per tile (tokens x packed heads): 16 for a decode-only batch (num_tokens <= num_seqs: one
    token's head group, padded to the 16 rows tl.dot needs); 128 when the batch is mostly long chunks
    (>= 64 tokens per sequence on average; 64 for head dims over 128); 64 for a mixed batch, where every
    decode sequence still occupies a whole tile, so smaller tiles waste less. tile_q is the number of
    query tokens per tile (rows = tile_q * next_pow2(Hq / Hkv)); tile_n the keys per KV tile. These
    defaults come from shapes alone; `experiments/kernels_gpu.py --sweep` measures the alternatives on a GPU.
    """
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_tokens <= num_seqs:
        rows = 16
    elif num_tokens >= 64 * num_seqs and d_pad <= 128:
        rows = 128
    else:
        rows = 64
    if tile_q is None:
        tile_q = max(1, rows // g_pad)
    if tile_q < 1 or tile_q & (tile_q - 1):
        raise ValueError(f"tile_q must be a power of two >= 1, got {tile_q}")
    if tile_q * g_pad < 16:
        raise ValueError(f"tile_q {tile_q} x {g_pad} packed heads = {tile_q * g_pad} rows: tl.dot needs >= 16")
    if tile_n is None:
        tile_n = 64 if d_pad <= 128 else 32
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    big = tile_q * g_pad >= 128
    return {
        "tile_q": tile_q,
        "tile_n": tile_n,
        "num_warps": num_warps or (8 if big else 4),
        "num_stages": num_stages or (2 if d_pad > 128 else 3),
    }


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-KV for decode batches too small to fill the GPU: aim for ~2 programs per SM.

    Shapes only (no host sync), so a split may find no KV tile on a short context: it then costs one
    nearly empty program. Prefill batches have enough query tiles and never split; neither does the
    interpreter (it runs programs one by one).
    """
    if INTERPRET or device.type != "cuda" or num_tokens > num_seqs:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    return min(_MAX_SPLITS, triton.cdiv(target, programs))


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, *, plan: Any = None,
                    out: Tensor | None = None, sliding_window: int | None = None, softcap: float | None = None,
                    sinks: Tensor | None = None, num_splits: int | None = None, tile_q: int | None = None,
                    tile_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """Attention of a mixed batch of decodes and prefill chunks over a paged KV cache; one launch.

    Same contract as `kernels.reference.paged_attention` (plan is accepted and ignored): query
    [num_tokens, Hq, D], rows cu_seqlens_q[i]:cu_seqlens_q[i+1] belong to sequence i; caches
    [num_blocks, block_size, Hkv, D]; block_tables [num_seqs, max_blocks] (entries past a sequence's
    last block are never read); seq_lens = cached + new tokens. Rows past cu_seqlens_q[-1] (padding)
    are left untouched. Returns [num_tokens, Hq, D] in query's dtype.

    sliding_window: query at position p sees keys in (p - sliding_window, p]; None or <= 0 = off.
    softcap: scores become softcap * tanh(scale * q.k / softcap) (Gemma 2); None or 0 = off.
    sinks: [Hq] per-head sink logits in the softmax denominator (gpt-oss), as the torch backend; None = off.
    num_splits: split-KV partitions (1 = off; None = `choose_num_splits`, 1 except small GPU decodes).
    tile_q / tile_n / num_warps / num_stages: tuning overrides, see `kernel_config`.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_dim = key_cache.shape
    if num_heads % num_kv_heads or kv_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} does not fit caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}: need Hq % Hkv == 0 and equal head dims")
    _check_last_dim(query, key_cache, value_cache)
    check_sinks(sinks, num_heads)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = kernel_config(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, tile_q=tile_q, tile_n=tile_n,
                        num_warps=num_warps, num_stages=num_stages)
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, num_seqs, num_kv_heads, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    fp32 = INTERPRET or query.dtype == torch.float32
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    if sinks is not None:
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    sinks_arg = query if sinks is None else sinks  # a pointer the kernel never reads without sinks
    cu_seqlens_q = cu_seqlens_q.contiguous()
    seq_lens = seq_lens.contiguous()

    split = num_splits > 1
    if split:
        p_out = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device)
        p_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
        p_strides = (p_out.stride(0), p_out.stride(1), p_out.stride(2), p_lse.stride(0), p_lse.stride(1))
    else:
        p_out = p_lse = out  # unused
        p_strides = (0, 0, 0, 0, 0)
    grid = (num_tokens // cfg["tile_q"] + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, p_out, p_lse, sinks_arg, block_tables, cu_seqlens_q, seq_lens,
        num_seqs, num_splits, float(scale), float(scale) * _LOG2E, float(softcap or 0.0),
        int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), *p_strides,
        G=group, G_PAD=triton.next_power_of_2(group), BLOCK_Q=cfg["tile_q"], BLOCK_N=cfg["tile_n"],
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
        SPLIT=split, USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, USE_SINKS=sinks is not None and not split,
        FP32=fp32,
        PRECISION="ieee" if fp32 else "tf32", RTNE_BF16=INTERPRET and out.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        # One program per (token, head) on GPU keeps registers small; the interpreter does all heads at once.
        block_h = triton.next_power_of_2(num_heads) if INTERPRET else 1
        _merge_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, p_out, p_lse, sinks_arg, num_heads, num_splits,
            out.stride(0), out.stride(1), *p_strides,
            BLOCK_H=block_h, S_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, D_PAD=d_pad,
            USE_SINKS=sinks is not None, RTNE_BF16=INTERPRET and out.dtype == torch.bfloat16, num_warps=4,
        )
    return out


def _check_last_dim(*tensors: Tensor) -> None:
    for x in tensors:
        if x.stride(-1) != 1:
            raise ValueError(f"tensor of shape {tuple(x.shape)} needs a contiguous last dimension "
                             f"(strides {x.stride()})")
