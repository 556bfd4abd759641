"""The Triton device code of the paged-attention backend (`kernels.triton_attention` launches it; the design is in
that module's docstring): `_write_kv_kernel` stores K/V rows at their slots, `_paged_attention_kernel` runs a step's
query tiles over their KV tiles (`_attend_tile` is one tile's online softmax), `_merge_kernel` combines split-KV
partial results by their log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

# tl.max / tl.sum / tl.zeros are themselves @triton.jit functions, decorated when triton is first imported.
# If that happened before TRITON_INTERPRET=1 was set (importing transformers' Llama imports triton), they
# cannot run in the interpreter, so the kernels use builtins only: tl.full, and tl.reduce with triton's
# own combine functions, which the interpreter recognises (numpy max / sum) without calling them.
from triton.language.standard import _elementwise_max as _max_fn
from triton.language.standard import _sum_combine as _sum_fn

# ------------------------------------------------------------------------------------------ helpers


@triton.jit
def _tanh(x):
    # libdevice.tanh is missing under the interpreter. exp(2x) -> inf gives 1, -> 0 gives -1: no NaN.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _cast_out(x, DTYPE: tl.constexpr, RTNE_BF16: tl.constexpr):
    """float32 -> DTYPE. The interpreter truncates fp32 -> bf16; RTNE_BF16 rounds to nearest even."""
    if RTNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + ((bits >> 16) & 1) + 0x7FFF
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# ------------------------------------------------------------------------------------ write_kv_cache


@triton.jit
def _write_kv_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    CONVERT: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if CONVERT:
        k = _cast_out(k.to(tl.float32), key_cache.dtype.element_ty, RTNE_BF16)
        v = _cast_out(v.to(tl.float32), value_cache.dtype.element_ty, RTNE_BF16)
    tl.store(key_cache + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :], k, mask=mask)
    tl.store(value_cache + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :], v, mask=mask)


# ----------------------------------------------------------------------------------- paged_attention


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, K, V, table, start, seq_len, q_pos,
    stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale, scale, softcap, window,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One KV tile of the online softmax; K/V already point at this program's KV head."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if MASKED:
        n_ok = n < seq_len
        # past the sequence's last block the table may hold anything: never index with it
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        k_mask = n_ok[None, :] & d_ok[:, None]
        v_mask = n_ok[:, None] & d_ok[None, :]
    else:
        blk = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
        k_mask = (n >= 0)[None, :] & d_ok[:, None]  # folds to the head-dim mask
        v_mask = (n >= 0)[:, None] & d_ok[None, :]
    off = n % BLOCK_SIZE
    # K^T: [D_PAD, BLOCK_N]; V: [BLOCK_N, D_PAD]
    k = tl.load(K + blk[None, :] * stride_kb + off[None, :] * stride_ks + d[:, None], mask=k_mask, other=0.0)
    v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :], mask=v_mask, other=0.0)
    if FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if USE_SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * qk_scale  # scale * log2(e): exp2 below
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_fn))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, _sum_fn)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


# Per-step ints are not specialised (a value of 1 or a multiple of 16 would otherwise mean a recompile).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window"])
def _paged_attention_kernel(
    Q, K, V, Out, P_OUT, P_LSE, Sinks, block_tables, cu_seqlens_q, seq_lens,
    num_seqs, num_splits, scale, qk_scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    FP32: tl.constexpr, PRECISION: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence owning grid slot `pid`: the last i with cu_seqlens_q[i] // BLOCK_Q + i <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_slot = tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid
        lo = tl.where(first_slot <= pid, mid, lo)
        hi = tl.where(first_slot <= pid, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    q_first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, within the sequence
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len  # absolute position of the sequence's first new token
    pos_first = ctx + q_first
    pos_last = ctx + tl.minimum(q_first + BLOCK_Q, q_len) - 1

    r = tl.arange(0, BLOCK_M)
    t = q_first + r // G_PAD
    g = r % G_PAD
    row_ok = (t < q_len) & (g < G)
    head = kvh * G + g
    tok = (q_start + t).to(tl.int64)
    q_pos = ctx + t
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)

    # KV range of the tile: [kv_lo, pos_last]. Tiles in [full_lo, full_hi) are seen whole by every row.
    kv_hi = tl.maximum(pos_last + 1, 0)
    if USE_WINDOW:
        kv_lo = tl.maximum(pos_first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(pos_last - window + 1 - kv_lo, 0) + BLOCK_N - 1) // BLOCK_N
    else:
        kv_lo = 0
        full_lo = 0
    num_tiles = (tl.maximum(kv_hi - kv_lo, 0) + BLOCK_N - 1) // BLOCK_N
    full_hi = tl.maximum(tl.maximum(pos_first + 1 - kv_lo, 0) // BLOCK_N, full_lo)
    per_split = (num_tiles + num_splits - 1) // num_splits
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)

    table = block_tables + seq.to(tl.int64) * stride_bt
    K += kvh.to(tl.int64) * stride_kh
    V += kvh.to(tl.int64) * stride_vh
    acc = tl.full([BLOCK_M, D_PAD], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for it in range(t0, tl.minimum(t1, full_lo)):  # window edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, K, V, table, kv_lo + it * BLOCK_N, seq_len, q_pos,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, scale, softcap, window,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, True, USE_WINDOW, USE_SOFTCAP, FP32, PRECISION)
    for it in range(tl.maximum(t0, full_lo), tl.minimum(t1, full_hi)):  # no mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, K, V, table, kv_lo + it * BLOCK_N, seq_len, q_pos,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, scale, softcap, window,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, False, USE_WINDOW, USE_SOFTCAP, FP32, PRECISION)
    for it in range(tl.maximum(t0, full_hi), t1):  # causal diagonal, end of the sequence
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, K, V, table, kv_lo + it * BLOCK_N, seq_len, q_pos,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, scale, softcap, window,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, True, USE_WINDOW, USE_SOFTCAP, FP32, PRECISION)

    if USE_SINKS:  # (unsplit only: with splits the merge adds the sink, once) a denominator term with no value
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_all)  # 0 for a row that saw no key: its output stays 0
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.math.exp2(sink - m_all)
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that saw no key: 0
    st_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        base = split.to(tl.int64) * stride_ps + tok * stride_pt + head * stride_ph
        tl.store(P_OUT + base[:, None] + d[None, :], o, mask=st_mask)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # log2 units
        tl.store(P_LSE + split.to(tl.int64) * stride_ls + tok * stride_lt + head, lse, mask=row_ok)
    else:
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 _cast_out(o, Out.dtype.element_ty, RTNE_BF16), mask=st_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    Out, P_OUT, P_LSE, Sinks, num_heads, num_splits,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    BLOCK_H: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Combine the splits' partial outputs of one token (BLOCK_H heads) by log-sum-exp."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    h_ok = h < num_heads
    s_ok = s < num_splits
    lse = tl.load(P_LSE + s[None, :] * stride_ls + tok * stride_lt + h[:, None],
                  mask=h_ok[:, None] & s_ok[None, :], other=float("-inf"))  # [BLOCK_H, S_PAD]
    m = tl.reduce(lse, 1, _max_fn)
    if USE_SINKS:
        sink = tl.load(Sinks + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2 units
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m[:, None])  # empty splits: 0
    den = tl.reduce(w, 1, _sum_fn)
    if USE_SINKS:
        den = den + tl.math.exp2(sink - m)
    mask3 = h_ok[:, None, None] & s_ok[None, :, None] & (d < HEAD_DIM)[None, None, :]
    part = tl.load(P_OUT + s[None, :, None] * stride_ps + tok * stride_pt + h[:, None, None] * stride_ph
                   + d[None, None, :], mask=mask3, other=0.0)  # [BLOCK_H, S_PAD, D_PAD]
    o = tl.reduce(part * w[:, :, None], 1, _sum_fn) / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(Out + tok * stride_ot + h[:, None] * stride_oh + d[None, :], _cast_out(o, Out.dtype.element_ty, RTNE_BF16),
             mask=h_ok[:, None] & (d < HEAD_DIM)[None, :])
