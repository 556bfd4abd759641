"""Triton fused mixture-of-experts: the experts of a sparse block as two grouped GEMMs over the (token, expert)
pairs sorted by expert. Same interface as `worker_svc.model.layers.moe.experts_torch`; the worker picks it on CUDA.

- **Alignment without a host sync.** The pairs are sorted by expert and each expert's run is padded to a multiple
  of BLOCK_M (`align_by_expert`, torch ops only), so every row tile of BLOCK_M pairs belongs to one expert. The
  padded length is bounded by `pairs + min(pairs, experts) * (BLOCK_M - 1)`, known on the host, so the grid is
  sized without reading the counts back; tiles past the real end carry expert id E and store nothing.
- **One kernel, two uses.** Tile (m, n) loads its expert id, gathers its pairs' input rows (`pair // top_k` of
  the tokens for gate/up, `pair` of the activations for down), multiplies by that expert's weight tile and
  writes its pairs' output rows. The down GEMM also scales each row by the pair's routing weight, in float32,
  before the single rounding to the activation dtype.
- **Between and after.** silu(gate) * up runs in torch on the [pairs, 2I] result; the weighted down outputs are
  summed per token over its top_k slots ([T, top_k, hidden].sum(1)), deterministic unlike atomic adds.
- **Precision.** Dots accumulate in float32 (IEEE, not TF32, for float32 inputs). Under TRITON_INTERPRET=1
  operands are converted to float32 first (bfloat16 arithmetic is not reliable in the interpreter).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["INTERPRET", "align_by_expert", "fused_experts"]


def _interpret() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRET = _interpret()  # read when the kernels are decorated, i.e. at import


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, route_w_ptr,
    num_pairs, num_experts, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, SCALE_ROWS: tl.constexpr, TO_FP32: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair, n] = sum_k A[pair // A_ROW_DIV, k] * W[expert, n, k] (* route_w[pair]) for the tile's pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    live = expert < num_experts
    expert = tl.where(live, expert, 0)  # a padding tile: addresses stay in range, nothing is stored

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < tl.where(live, num_pairs, 0)  # (a scalar & a vector loses its bool dtype in the interpreter)
    a_row = tl.where(valid, pair // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if TO_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if SCALE_ROWS:
        scale = tl.load(route_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def align_by_expert(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(pairs, block_expert): flattened (token, slot) pair indices grouped by expert, each expert's run padded to
    a multiple of block_m with the sentinel `ids.numel()`; and each tile's expert (num_experts past the end)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts unpadded / padded
    padded_first = padded_end - padded
    expert_of = flat[order]
    slot = padded_first[expert_of] + torch.arange(num_pairs, device=ids.device) - first[expert_of]
    length = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    length = -(-length // block_m) * block_m
    pairs = torch.full((length,), num_pairs, dtype=torch.int64, device=ids.device)
    pairs[slot] = order
    tile_start = torch.arange(0, length, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    return pairs, block_expert


def _block_sizes(num_pairs: int) -> tuple[int, int, int]:
    if INTERPRET:
        return 16, 32, 32  # small tiles: the interpreter's cost grows with the tile
    if num_pairs <= 64:
        return 16, 64, 64  # decode: few pairs per expert
    return 64, 64, 32


def _grouped_gemm(a: Tensor, w: Tensor, out: Tensor, pairs: Tensor, block_expert: Tensor, route_w: Tensor,
                  num_pairs: int, a_row_div: int, scale_rows: bool, blocks: tuple[int, int, int]) -> None:
    block_m, block_n, block_k = blocks
    num_experts, n, k = w.shape
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, pairs, block_expert, route_w,
        num_pairs, num_experts, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, SCALE_ROWS=scale_rows, TO_FP32=INTERPRET, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """sum over each token's experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): x [T, hidden], weights
    and ids [T, top_k], gate_up [E, 2I, hidden], down [E, hidden, I] -> [T, hidden] in x's dtype."""
    num_tokens, top_k = ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    blocks = _block_sizes(num_pairs)
    pairs, block_expert = align_by_expert(ids, gate_up.shape[0], blocks[0])
    route_w = weights.reshape(-1).contiguous()
    gate_up_out = torch.empty(num_pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, gate_up_out, pairs, block_expert, route_w, num_pairs, top_k, False, blocks)
    gate, up = gate_up_out.chunk(2, dim=-1)
    act = F.silu(gate) * up  # [pairs, I], contiguous
    down_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, down_out, pairs, block_expert, route_w, num_pairs, 1, True, blocks)
    return down_out.view(num_tokens, top_k, hidden).sum(dim=1)
