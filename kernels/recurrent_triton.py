"""Triton kernels for the recurrent layers' decode step (CUDA; the interpreter runs them on CPU for tests).

The torch path (worker_svc/model/layers/gated_delta_rule.py, ssd_scan.py, causal_conv.py, whose ops' forward_cuda
call these kernels for the decode rows) gathers each decoding sequence's state out of the pool, updates it and writes
it back: two extra passes over every state matrix per layer and step, which the CPU profile shows as the largest part
of a hybrid model's decode. These kernels update the pool in place
instead: one program per (sequence, head) reads its slot's matrix once, applies the gated delta rule or Mamba2's
scan step and writes it back; one program per (sequence, channel block) shifts its conv window. Same arithmetic as
the torch path, in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv1d_decode", "gated_delta_rule_decode", "ssd_decode"]


@triton.jit
def _delta_rule_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slot_ptr,
                              heads, key_dim, value_dim,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    rv = tl.arange(0, BLOCK_V)
    mk = rk < key_dim
    mv = rv < value_dim
    row = n * heads + h
    q = tl.load(q_ptr + row * key_dim + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * key_dim + rk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * value_dim + rv, mask=mv, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + row).to(tl.float32))
    beta = tl.load(beta_ptr + row).to(tl.float32)
    base = state_ptr + (slot * heads + h) * key_dim * value_dim
    offs = rk[:, None] * value_dim + rv[None, :]
    m = mk[:, None] & mv[None, :]
    s = tl.load(base + offs, mask=m, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(base + offs, s.to(state_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + row * value_dim + rv, tl.sum(s * q[:, None], axis=0), mask=mv)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence, the pool updated in place: q, k [N, H, dk] (normalised, q scaled, one per value
    head), v [N, H, dv], g and beta [N, H]; states [S, H, dk, dv] read and written at slots [N]. Returns o
    [N, H, dv] float32."""
    n, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(n, heads, value_dim, dtype=torch.float32, device=v.device)
    if n:
        _delta_rule_decode_kernel[(n, heads)](q, k, v, g, beta, out, states, slots.contiguous(), heads, key_dim,
                                              value_dim, BLOCK_K=triton.next_power_of_2(key_dim),
                                              BLOCK_V=triton.next_power_of_2(value_dim))
    return out


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, b_ptr, out_ptr, state_ptr, slot_ptr, channels,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = rc < channels
    slot = tl.load(slot_ptr + n).to(tl.int64)
    x = tl.load(x_ptr + n * channels + rc, mask=mc, other=0.0).to(tl.float32)
    window = state_ptr + (slot * channels + rc) * WIDTH
    acc = tl.load(w_ptr + rc * (WIDTH + 1) + WIDTH, mask=mc, other=0.0).to(tl.float32) * x
    for j in tl.static_range(WIDTH):
        old = tl.load(window + j, mask=mc, other=0.0)
        acc += tl.load(w_ptr + rc * (WIDTH + 1) + j, mask=mc, other=0.0).to(tl.float32) * old.to(tl.float32)
        if j > 0:  # shift the window one step: slot j - 1 takes slot j's value
            tl.store(window + j - 1, old, mask=mc)
    tl.store(window + WIDTH - 1, x.to(state_ptr.dtype.element_ty), mask=mc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rc, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + n * channels + rc, acc.to(out_ptr.dtype.element_ty), mask=mc)


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                  slots: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """One token per sequence: x [N, C], weight [C, K]; the windows states [S, C, K - 1] at slots [N] are read and
    shifted in place. Returns y [N, C] in x's dtype."""
    n, channels = x.shape
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    if n:
        block = min(256, triton.next_power_of_2(channels))
        x, weight = x.contiguous(), weight.contiguous()
        _conv_decode_kernel[(n, triton.cdiv(channels, block))](
            x, weight, bias if bias is not None else weight, out, states, slots.contiguous(), channels,
            WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block)
    return out


@triton.jit
def _ssd_decode_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, out_ptr, state_ptr, slot_ptr, heads, head_dim, state_size,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rp = tl.arange(0, BLOCK_P)
    rn = tl.arange(0, BLOCK_N)
    mp = rp < head_dim
    mn = rn < state_size
    row = n * heads + h
    x = tl.load(x_ptr + row * head_dim + rp, mask=mp, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * state_size + rn, mask=mn, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * state_size + rn, mask=mn, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row).to(tl.float32)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    base = state_ptr + (slot * heads + h) * head_dim * state_size
    offs = rp[:, None] * state_size + rn[None, :]
    m = mp[:, None] & mn[None, :]
    s = tl.load(base + offs, mask=m, other=0.0).to(tl.float32) * decay + (dt * x)[:, None] * b[None, :]
    tl.store(base + offs, s.to(state_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + row * head_dim + rp, tl.sum(s * c[None, :], axis=1), mask=mp)


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Mamba2's scan for one token per sequence, the pool updated in place: x [N, H, P], dt [N, H], a [H], b and c
    [N, H, N_state] (one per head); states [S, H, P, N_state] at slots [N]. Returns y [N, H, P] float32 (without
    the D skip)."""
    n, heads, head_dim = x.shape
    state_size = b.shape[-1]
    x, dt, a, b, c = (t.contiguous() for t in (x, dt, a, b, c))
    out = torch.empty(n, heads, head_dim, dtype=torch.float32, device=x.device)
    if n:
        _ssd_decode_kernel[(n, heads)](x, dt, a, b, c, out, states, slots.contiguous(), heads, head_dim, state_size,
                                       BLOCK_P=triton.next_power_of_2(head_dim),
                                       BLOCK_N=triton.next_power_of_2(state_size))
    return out
