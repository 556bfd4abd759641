"""Triton dequantize-GEMM for int4 weights in groups of 32 (worker_svc/model/quant.py's CUDA path).

y[m, n] = sum_k x[m, k] * (scale[n, k // 32] * q[n, k] + zero[n, k // 32]), with q two codes a byte along k
(element 2j in the low nibble of byte j, 2j+1 in the high one). Each program owns a BLOCK_M x BLOCK_N tile of
y and walks k one group at a time: the group's codes are unpacked and scaled in registers, so the weight is
read from memory at half a byte per value and never written dequantized. Accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP_K)
    m_ok = rm < M
    n_ok = rn < N
    groups = K // GROUP_K
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for g in range(0, groups):
        k = g * GROUP_K + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        packed = tl.load(q_ptr + rn[None, :] * (K // 2) + (k // 2)[:, None], mask=n_ok[None, :], other=0)
        codes = ((packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF).to(tl.float32)  # [GROUP_K, BLOCK_N]
        s = tl.load(scale_ptr + rn * groups + g, mask=n_ok, other=0.0)
        z = tl.load(zero_ptr + rn * groups + g, mask=n_ok, other=0.0)
        w = codes * s[None, :] + z[None, :]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequantized(packed [N, K / 2] uint8, scale / zero [N, K / 32] float32).T -> [M, N] in x.dtype."""
    m, k = x.shape
    n = packed.shape[0]
    if k % GROUP or packed.shape[1] * 2 != k or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"int4_matmul: x {tuple(x.shape)}, codes {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed, scale, zero, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_K=GROUP)
    return y
