"""Triton LoRA kernels, Punica style: each token row carries the pool slot of its adapter (-1: none), so one launch
serves a batch that mixes adapters.

- `lora_shrink`: s[t] = A[slot[t]] @ x[t]  ([T, in] -> [T, R]), one program per (token, block of R).
- `lora_expand`: y[t] += B[slot[t]] @ s[t] ([T, R] -> added into [T, out]), one program per (token, block of out).

Rows with slot -1 exit at once (their s is left unwritten; expand never reads it). Accumulation is float32. The
reductions use tl.reduce with triton's own combine function, which the interpreter (TRITON_INTERPRET=1) runs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine as _sum_fn

__all__ = ["lora_shrink", "lora_expand"]


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, K, R, stride_xt, stride_as, stride_ar, stride_ot,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.full((BLOCK_R,), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.reduce(a * x[None, :], 1, _sum_fn)
        tl.store(out_ptr + t * stride_ot + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, N, R, stride_st, stride_bs, stride_bn, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + t * stride_st + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.reduce(b * s[None, :], 1, _sum_fn)
        y = tl.load(y_ptr + t * stride_yt + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + n, (y + delta).to(y_ptr.dtype.element_ty), mask=n < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K] (rows contiguous), token_slots [T] int64 -> [T, R] float32."""
    T, K = x.shape
    R = a.shape[1]
    out = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    block_r = min(triton.next_power_of_2(R), 64)
    grid = (T, triton.cdiv(R, block_r))
    _shrink_kernel[grid](x, a, token_slots, out, K, R, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
                         BLOCK_R=block_r, BLOCK_K=64)
    return out


def lora_expand(s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """y [T, N] += b[token_slots[t]] @ s[t], in place; s [T, R] float32, b [S, N, R] (rows contiguous)."""
    T, N = y.shape
    R = b.shape[2]
    if T == 0:
        return
    assert y.stride(1) == 1 and b.stride(-1) == 1, "expand needs unit-stride rows"
    block_n = 64
    grid = (T, triton.cdiv(N, block_n))
    _expand_kernel[grid](s, b, token_slots, y, N, R, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                         BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(R))
