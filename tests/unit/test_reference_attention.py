"""The torch paged-attention reference against dense causal SDPA computed per sequence."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import (
    build_attention_metadata,
    build_reference_plan,
    paged_attention,
    write_kv_cache,
)
from kernels.reference import DECODE_GROUP_ROWS


def make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0,
               pad_value=-1):
    """A NaN-filled cache holding random K/V for each (query_len, seq_len), in shuffled blocks.

    Returns query, caches, the dense per-sequence K/V, and block tables padded with `pad_value`
    (entries past each sequence's last block are garbage, as the kernel contract allows).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-s // block_size) for _, s in shapes]
    num_blocks = sum(need) + 7  # spare blocks stay NaN
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    tables, dense = [], []
    for n, (_, s) in zip(need, shapes, strict=True):
        table, ids = ids[:n], ids[n:]
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(s):  # written token by token: the tail of the last block stays NaN
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        dense.append((k, v))
    width = max(need) + 2
    padded = torch.full((len(shapes), width), pad_value, dtype=torch.int32)
    for i, table in enumerate(tables):
        padded[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    total_q = sum(q for q, _ in shapes)
    query = torch.randn(total_q, num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, tables, padded, dense


def dense_reference(query, shapes, dense, scale):
    """Per sequence: float64 SDPA of its query rows over its dense K/V, bottom-right causal."""
    outs, row = [], 0
    num_heads = query.shape[1]
    for (q_len, s), (k, v) in zip(shapes, dense, strict=True):
        group = num_heads // k.shape[1]
        q = query[row:row + q_len].double().transpose(0, 1)  # [Hq, q_len, D]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.ones(q_len, s, dtype=torch.bool).tril(diagonal=s - q_len)
        outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
        row += q_len
    return torch.cat(outs)


def cu_seqlens(shapes):
    return torch.tensor([0] + [sum(q for q, _ in shapes[:i + 1]) for i in range(len(shapes))],
                        dtype=torch.int32)


def run_paged(query, key_cache, value_cache, padded, shapes, scale, plan=None):
    seq_lens = torch.tensor([s for _, s in shapes], dtype=torch.int32)
    return paged_attention(query, key_cache, value_cache, padded, cu_seqlens(shapes), seq_lens, scale,
                           plan=plan)


MIXED = [(1, 37), (5, 20), (1, 16), (16, 48), (1, 1), (7, 7), (3, 64), (1, 100), (32, 33)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(4, 4, 64, 16), (9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 128, 32), (16, 2, 64, 16)],
)
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, head_dim, block_size):
    shapes = MIXED
    scale = head_dim ** -0.5
    query, kc, vc, _, padded, dense = make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size)
    out = run_paged(query, kc, vc, padded, shapes, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_reference(query, shapes, dense, scale), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    rng = random.Random(100 + seed)
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 3, 8])
    head_dim = rng.choice([64, 128])
    block_size = rng.choice([16, 16, 32])
    shapes = []
    for _ in range(rng.randint(1, 10)):
        s = rng.choice([rng.randint(1, 150), block_size * rng.randint(1, 5)])
        q = 1 if rng.random() < 0.5 else rng.randint(1, s)
        shapes.append((q, s))
    scale = head_dim ** -0.5
    query, kc, vc, _, padded, dense = make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size,
                                                 seed=seed, pad_value=rng.choice([-1, 0, 10**6]))
    out = run_paged(query, kc, vc, padded, shapes, scale)
    torch.testing.assert_close(out.double(), dense_reference(query, shapes, dense, scale), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 5), (1, 16), (1, 17), (1, 64)],  # decodes only
        [(40, 40)],  # one prompt, no cached context, ends mid-block
        [(32, 32)],  # one prompt, exact multiple of the block size
        [(24, 88)],  # one chunk over cached context
        [(9, 30), (1, 12), (1, 50)],  # prefill rows first: decode outputs are scattered
    ],
)
def test_special_batches(shapes):
    scale = 0.125
    query, kc, vc, _, padded, dense = make_batch(shapes, 9, 3, 64, 16, seed=3)
    out = run_paged(query, kc, vc, padded, shapes, scale)
    torch.testing.assert_close(out.double(), dense_reference(query, shapes, dense, scale), atol=1e-4, rtol=1e-4)


def test_bfloat16():
    shapes = MIXED
    scale = 64 ** -0.5
    query, kc, vc, _, padded, dense = make_batch(shapes, 9, 3, 64, 16, dtype=torch.bfloat16)
    out = run_paged(query, kc, vc, padded, shapes, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(query, shapes, dense, scale), atol=3e-2, rtol=3e-2)


def test_prebuilt_plan_matches_plan_none_and_out():
    shapes = MIXED
    query, kc, vc, tables, padded, _ = make_batch(shapes, 9, 3, 64, 16)
    meta = build_attention_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, 16, "cpu")
    fresh = paged_attention(query, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125)
    planned = paged_attention(query, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125,
                              plan=meta.plan)
    torch.testing.assert_close(planned, fresh, atol=0, rtol=0)
    # the plan does not depend on the table padding: -1 padded tables give the same result
    garbage = run_paged(query, kc, vc, padded, shapes, 0.125, plan=meta.plan)
    torch.testing.assert_close(garbage, fresh, atol=0, rtol=0)
    buf = torch.full_like(query, float("nan"))
    ret = paged_attention(query, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125,
                          plan=meta.plan, out=buf)
    assert ret is buf
    torch.testing.assert_close(buf, fresh, atol=0, rtol=0)


def test_rows_with_no_visible_key_are_zero():
    # query_len > seq_len is invalid input, but such rows must give zeros, never NaN
    query, kc, vc, _, padded, _ = make_batch([(2, 2)], 4, 2, 64, 16)
    seq_lens = torch.tensor([2], dtype=torch.int32)
    query3 = torch.cat([torch.randn(1, 4, 64), query])
    out = paged_attention(query3, kc, vc, padded, torch.tensor([0, 3], dtype=torch.int32), seq_lens, 0.125)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    assert (out[1:] != 0).any(dim=-1).all()


def test_empty_batch():
    kc = torch.zeros(4, 16, 2, 64)
    query = torch.zeros(0, 4, 64)
    meta = build_attention_metadata([], [], [], 16, "cpu")
    out = paged_attention(query, kc, kc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125,
                          plan=meta.plan)
    assert out.shape == (0, 4, 64)


def test_write_kv_cache_skips_padding_slots():
    num_layers, num_blocks, block_size, hkv, d = 2, 4, 16, 3, 8
    kv = torch.full((num_layers, 2, num_blocks, block_size, hkv, d), float("nan"))
    key, value = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    slots = torch.tensor([5, -1, 2 * block_size + 15, 3 * block_size], dtype=torch.int64)
    write_kv_cache(key, value, kv[1, 0], kv[1, 1], slots)
    flat_k = kv[1, 0].reshape(-1, hkv, d)
    flat_v = kv[1, 1].reshape(-1, hkv, d)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[i]) and torch.equal(flat_v[slot], value[i])
    assert int(torch.isfinite(kv[1]).all(dim=(-1, -2)).sum()) == 2 * 3  # only the 3 real slots written
    assert torch.isnan(kv[0]).all()  # other layer untouched


def test_write_then_attend_end_to_end():
    # cached context written directly, the step's new tokens via write_kv_cache + metadata slots
    shapes = [(1, 30), (12, 40), (1, 17)]
    query, kc, vc, tables, _, dense = make_batch(shapes, 8, 2, 64, 16, seed=7)
    meta = build_attention_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, 16, "cpu")
    new_k = torch.cat([k[s - q:] for (q, s), (k, _) in zip(shapes, dense, strict=True)])
    new_v = torch.cat([v[s - q:] for (q, s), (_, v) in zip(shapes, dense, strict=True)])
    flat = meta.slot_mapping
    kc.view(-1, 2, 64)[flat] = float("nan")  # forget the new tokens: write_kv_cache must restore them
    vc.view(-1, 2, 64)[flat] = float("nan")
    write_kv_cache(new_k, new_v, kc, vc, meta.slot_mapping)
    out = paged_attention(query, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125,
                          plan=meta.plan)
    torch.testing.assert_close(out.double(), dense_reference(query, shapes, dense, 0.125), atol=1e-4, rtol=1e-4)


def test_build_attention_metadata_values():
    meta = build_attention_metadata(
        query_lens=[1, 3, 2],
        seq_lens=[18, 3, 33],
        block_tables=[[7, 2], [5], [0, 9, 4, 6]],  # the last one holds a spare block
        block_size=16,
        device="cpu",
    )
    # seq 0: position 17 -> block 2 offset 1; seq 1: positions 0..2 of block 5;
    # seq 2: positions 31, 32 -> block 9 offset 15, block 4 offset 0
    assert meta.slot_mapping.tolist() == [2 * 16 + 1, 80, 81, 82, 9 * 16 + 15, 4 * 16]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2, 0, 0], [5, 0, 0, 0], [0, 9, 4, 6]]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4, 6] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seq_lens.tolist() == [18, 3, 33] and meta.seq_lens.dtype == torch.int32
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size) == (3, 33, 16)
    assert meta.plan is not None and meta.plan.num_tokens == 6
    assert build_attention_metadata([1], [1], [[0]], 16, "cpu", build_plan=False).plan is None


def test_build_attention_metadata_rejects_bad_input():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [33], [[0, 1]], 16, "cpu")
    with pytest.raises(ValueError, match="query_len"):
        build_attention_metadata([5], [4], [[0]], 16, "cpu")


def test_plan_groups_decodes_and_prefills():
    plan = build_reference_plan(torch.zeros(4, 8, dtype=torch.int32), [1, 6, 1, 5], [20, 100, 40, 96], 16,
                                decode_kernel=False)
    decode, prefill = plan.groups
    assert (decode.num_seqs, decode.max_q, decode.kv_len, decode.num_blocks) == (2, 1, 40, 3)
    assert (prefill.num_seqs, prefill.max_q, prefill.kv_len, prefill.num_blocks) == (2, 6, 100, 7)
    assert decode.rows.tolist() == [0, 7] and sorted(prefill.rows.tolist()) == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]


def test_prefills_of_very_different_shapes_are_not_padded_together():
    # A 4k-token prompt with short ones: padding them together would cost ~4k x 4k scores per short prompt.
    q = [4000, 100, 110, 6, 1]
    plan = build_reference_plan(torch.zeros(5, 256, dtype=torch.int32), q, [4000, 100, 110, 90, 50], 16,
                                decode_kernel=False)
    shapes = sorted((g.num_seqs, g.max_q, g.kv_len) for g in plan.groups)
    assert shapes == [(1, 1, 50), (1, 6, 90), (1, 4000, 4000), (2, 110, 110)]
    assert sorted(r for g in plan.groups for r in g.rows.tolist()) == list(range(sum(q)))


def test_decodes_are_grouped_by_context_length():
    # 2k-token contexts among 200-token ones, interleaved in batch order: sorted and cut so no short context is
    # padded to 2k; on CPU also capped at DECODE_GROUP_ROWS gathered rows per group.
    seq = [200 if i % 8 else 2000 for i in range(64)]
    plan = build_reference_plan(torch.zeros(64, 128, dtype=torch.int32), [1] * 64, seq, 16, device="cpu",
                                decode_kernel=False)
    for g in plan.groups:
        lens = {seq[r] for r in g.rows.tolist()}
        assert len(lens) == 1 and g.num_seqs * g.num_blocks * 16 <= max(DECODE_GROUP_ROWS, g.num_blocks * 16)
    assert sorted(r for g in plan.groups for r in g.rows.tolist()) == list(range(64))


@pytest.mark.parametrize("shapes", [MIXED, [(1, 20), (1, 33)], [(40, 50)]])
def test_query_sliced_from_fused_qkv(shapes):
    # the model may hand in q as a strided view of a fused qkv projection
    query, kc, vc, _, padded, _ = make_batch(shapes, 9, 3, 64, 16)
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 3 * 64)], dim=1)
    strided = fused[:, :9 * 64].view(-1, 9, 64)
    assert not strided.is_contiguous()
    expected = run_paged(query, kc, vc, padded, shapes, 0.125)
    torch.testing.assert_close(run_paged(strided, kc, vc, padded, shapes, 0.125), expected, atol=0, rtol=0)
