"""Triton paged-attention kernels against the torch reference (and dense float64 math for the options the
reference lacks: sliding window, softcap). On CPU they run under TRITON_INTERPRET=1.

The grid covers every value of each axis the kernel issue names -- dtypes, (Hq, Hkv), head dims
(incl. 80), block sizes, KV tiles equal to / different from the block size, query tiles of one and of
several per sequence, sequence mixes, split-KV 1/4/16 -- combined so that each head layout meets each
head dim and each mix, not as a full product (the interpreter runs ~4 ms per tile iteration).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before kernels.triton_attention is imported (triton.jit picks the interpreter at decoration time), and
    # for the rest of the session (the interpreter reads it again at run time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import kernels.reference as ref  # noqa: E402
from kernels import triton_attention as tri  # noqa: E402
from tests.unit.test_reference_attention import cu_seqlens, make_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not tri.INTERPRET:
    raise RuntimeError("kernels.triton_attention was imported without TRITON_INTERPRET=1 and there is no GPU "
                       "(tests/conftest.py sets it before any import)")

TOL = {torch.float32: (1e-3, 1e-3), torch.float16: (1.5e-2, 1e-2), torch.bfloat16: (1.5e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (8, 2), (6, 2), (16, 1)]
DIMS = [64, 128, 80]
MIXES = {
    "decode": [(1, 37), (1, 16), (1, 32), (1, 1), (1, 70)],
    "mixed": [(1, 150), (5, 18), (33, 97)],                  # long decode, short chunk, long chunk
    "mid_block": [(20, 45), (1, 9), (7, 39)],                # chunks starting inside a block
    "prefill": [(40, 40), (16, 16), (32, 32), (3, 3)],
    "exact": [(16, 32), (1, 16), (32, 32), (1, 32), (16, 16)],  # lengths exactly 16 and 32
}


def _grid():
    """(dtype, heads, dim, mix, block_size, tile_n, small_q_tile): 12 layouts x 5 mixes = 60 cases."""
    cases = []
    for i, heads in enumerate(HEADS):
        for j, dim in enumerate(DIMS):
            for k, mix in enumerate(MIXES):
                n = i + j + k
                dtype = DTYPES[(i + 2 * j + k) % 3]
                block_size = (16, 32)[n % 2]
                tile_n = (block_size, 16, 32, 64)[(i + k) % 4]  # == block size, smaller, larger
                small_q = (j + k) % 2 == 1  # several query tiles per sequence
                cases.append(pytest.param(dtype, heads, dim, mix, block_size, tile_n, small_q,
                                          id=f"{str(dtype)[6:]}-{heads[0]}x{heads[1]}-d{dim}-{mix}-b{block_size}"
                                             f"-n{tile_n}{'-qs' if small_q else ''}"))
    return cases


def _batch(shapes, heads, dim, block_size, dtype, seed=0, pad_value=-1):
    query, kc, vc, tables, padded, dense = make_batch(shapes, heads[0], heads[1], dim, block_size, dtype, seed=seed,
                                                      pad_value=pad_value)
    seq_lens = torch.tensor([s for _, s in shapes], dtype=torch.int32)
    tensors = [query, kc, vc, padded, cu_seqlens(shapes), seq_lens]
    return [x.to(DEVICE) for x in tensors], dense


def _min_tile_q(heads):
    return max(1, 16 // triton.next_power_of_2(heads[0] // heads[1]))


def _check(out, expected, dtype, what=""):
    atol, rtol = TOL[dtype]
    assert not out.isnan().any(), f"NaN in output {what}"
    err = (out.float() - expected.float()).abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol, msg=f"{what}: max err {err}")


@pytest.mark.parametrize("dtype,heads,dim,mix,block_size,tile_n,small_q", _grid())
def test_matches_reference(dtype, heads, dim, mix, block_size, tile_n, small_q):
    shapes = MIXES[mix]
    # garbage (not just -1 / 0) past each table's end: the kernel must never read it
    (q, kc, vc, tables, cu, lens), _ = _batch(shapes, heads, dim, block_size, dtype, pad_value=1 << 30)
    scale = dim ** -0.5
    expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), scale)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, scale, tile_n=tile_n,
                              tile_q=_min_tile_q(heads) if small_q else None)
    assert out.shape == q.shape and out.dtype == dtype
    _check(out.cpu(), expected, dtype, f"{mix} {heads} d{dim}")


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("mix,heads,dim,dtype,block_size,tile_n", [
    ("decode", (8, 2), 64, torch.float32, 16, 32),
    ("decode", (16, 1), 128, torch.bfloat16, 32, 16),
    ("mixed", (6, 2), 80, torch.float16, 16, 64),     # 16 splits > the tiles of every short sequence
    ("exact", (4, 4), 64, torch.bfloat16, 32, 32),
])
def test_split_kv_matches_reference(num_splits, mix, heads, dim, dtype, block_size, tile_n):
    shapes = MIXES[mix]
    (q, kc, vc, tables, cu, lens), _ = _batch(shapes, heads, dim, block_size, dtype, seed=3)
    scale = dim ** -0.5
    expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), scale)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, scale, num_splits=num_splits, tile_n=tile_n)
    _check(out.cpu(), expected, dtype, f"{num_splits} splits")


def _dense(query, shapes, dense, scale, window=None, softcap=None):
    """float64 per-sequence attention with bottom-right causal mask, optional window and softcap."""
    outs, row = [], 0
    for (q_len, s), (k, v) in zip(shapes, dense, strict=True):
        group = query.shape[1] // k.shape[1]
        q = query[row:row + q_len].double().transpose(0, 1)                 # [Hq, q_len, D]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)          # [Hq, s, D]
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ kk.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(s - q_len, s)[:, None]
        k_pos = torch.arange(s)[None]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        outs.append((probs @ vv).transpose(0, 1))
        row += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("window,softcap,num_splits,tile_n,dtype", [
    (1, None, 1, 16, torch.float32),        # each query sees only itself
    (7, None, 1, 16, torch.float32),
    (40, None, 4, 32, torch.float32),       # window across tiles and blocks, split
    (None, 5.0, 1, 32, torch.float32),
    (None, 0.5, 4, 16, torch.bfloat16),     # strong capping
    (20, 30.0, 1, 64, torch.float16),
    (1000, None, 1, 32, torch.float32),     # window longer than every sequence: plain causal
])
def test_sliding_window_and_softcap(window, softcap, num_splits, tile_n, dtype):
    shapes = [(1, 150), (5, 18), (33, 97), (20, 45)]
    heads, dim = (8, 2), 64
    (q, kc, vc, tables, cu, lens), dense = _batch(shapes, heads, dim, 16, dtype, seed=5)
    scale = dim ** -0.5
    expected = _dense(q.cpu(), shapes, dense, scale, window, softcap)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, scale, sliding_window=window, softcap=softcap,
                              num_splits=num_splits, tile_n=tile_n, tile_q=4)
    _check(out.cpu(), expected, dtype, f"window {window} softcap {softcap}")


def test_window_none_equals_reference_path():
    shapes = MIXES["mixed"]
    (q, kc, vc, tables, cu, lens), dense = _batch(shapes, (4, 4), 64, 16, torch.float32, seed=9)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, 0.125, sliding_window=None, softcap=None)
    torch.testing.assert_close(out.cpu().double(), _dense(q.cpu(), shapes, dense, 0.125), atol=1e-4, rtol=1e-4)


def test_padding_rows_untouched_and_into_out():
    # CUDA-graph style padding: query rows past cu_seqlens_q[-1] belong to no sequence.
    shapes = [(1, 37), (6, 20)]
    (q, kc, vc, tables, cu, lens), _ = _batch(shapes, (8, 2), 64, 16, torch.float32, seed=2)
    padded_q = torch.cat([q, torch.randn(5, *q.shape[1:], device=q.device)])
    out = torch.full_like(padded_q, 7.0)
    res = tri.paged_attention(padded_q, kc, vc, tables, cu, lens, 0.125, out=out)
    assert res is out
    expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), 0.125)
    _check(out[:len(q)].cpu(), expected, torch.float32)
    assert bool((out[len(q):] == 7.0).all())


def test_rows_that_see_no_key_are_zero():
    # query_len > seq_len (outside the metadata contract): the reference zeros such rows; so must we.
    # Sequence 0 has 4 new queries but seq_len 2: its first two queries sit at positions -2 and -1.
    (_, kc, vc, tables, _, lens), _ = _batch([(2, 2), (1, 5)], (4, 4), 64, 16, torch.float32)
    q = torch.randn(5, 4, 64, device=kc.device)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32, device=kc.device)
    for num_splits in (1, 2):
        out = tri.paged_attention(q, kc, vc, tables, cu, lens, 0.125, num_splits=num_splits)
        expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), 0.125)
        assert not out.isnan().any()
        assert bool((out[:2] == 0).all())
        _check(out.cpu(), expected, torch.float32, f"{num_splits} splits")


def test_empty_sequences_and_empty_batch():
    (q, kc, vc, tables, cu, lens), _ = _batch([(3, 10), (1, 4)], (4, 4), 64, 16, torch.float32)
    # a sequence scheduled with no new token sits between two real ones
    tables = torch.cat([tables[:1], tables[:1], tables[1:]])
    cu = torch.tensor([0, 3, 3, 4], dtype=torch.int32, device=q.device)
    lens = torch.tensor([10, 6, 4], dtype=torch.int32, device=q.device)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, 0.125)
    expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), 0.125)
    _check(out.cpu(), expected, torch.float32)
    empty = tri.paged_attention(q[:0], kc, vc, tables[:0], cu[:1], lens[:0], 0.125)
    assert empty.shape == (0, 4, 64)


def test_cache_views_of_one_tensor():
    # The worker passes kv[l, 0] / kv[l, 1] of one [L, 2, num_blocks, block_size, Hkv, D] tensor.
    shapes = MIXES["mixed"]
    (q, kc, vc, tables, cu, lens), _ = _batch(shapes, (6, 2), 64, 16, torch.float16, seed=4)
    kv = torch.full((2, 2, *kc.shape), float("nan"), dtype=kc.dtype, device=kc.device)
    kv[1, 0], kv[1, 1] = kc, vc
    out = tri.paged_attention(q, kv[1, 0], kv[1, 1], tables, cu, lens, 0.125)
    expected = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), 0.125)
    _check(out.cpu(), expected, torch.float16)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_write_kv_cache_matches_reference(src, dst):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, dim = 9, 16, 3, 80
    kv_ref = torch.full((2, 2, num_blocks, block_size, hkv, dim), float("nan"), dtype=dst)
    kv_tri = kv_ref.clone().to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    slots[[3, 17, 39]] = -1  # padding tokens
    key = torch.randn(40, hkv, dim, generator=gen).to(src)
    value = torch.randn(40, hkv, dim, generator=gen).to(src)
    ref.write_kv_cache(key, value, kv_ref[1, 0], kv_ref[1, 1], slots)
    tri.write_kv_cache(key.to(DEVICE), value.to(DEVICE), kv_tri[1, 0], kv_tri[1, 1], slots.to(DEVICE))
    # exact, NaN in the same places (untouched slots and layer 0 stay NaN)
    torch.testing.assert_close(kv_tri.cpu(), kv_ref, atol=0, rtol=0, equal_nan=True)


def test_write_then_attend_with_int32_slots_and_strided_key():
    # slot_mapping may arrive as int32; key/value may be strided slices of a fused qkv tensor.
    hq, hkv, dim, block_size = 8, 2, 64, 16
    qkv = torch.randn(21, (hq + 2 * hkv) * dim, device=DEVICE)
    q = qkv[:, :hq * dim].view(21, hq, dim)
    k = qkv[:, hq * dim:(hq + hkv) * dim].view(21, hkv, dim)
    v = qkv[:, (hq + hkv) * dim:].view(21, hkv, dim)
    meta = ref.build_attention_metadata([1, 20], [1, 20], [[3], [5, 1]], block_size, DEVICE, build_plan=False)
    kc = torch.full((6, block_size, hkv, dim), float("nan"), device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    tri.write_kv_cache(k, v, kc, vc, meta.slot_mapping.to(torch.int32))
    out = tri.paged_attention(q, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125)
    kc_ref, vc_ref = torch.full_like(kc.cpu(), float("nan")), torch.full_like(vc.cpu(), float("nan"))
    ref.write_kv_cache(k.cpu(), v.cpu(), kc_ref, vc_ref, meta.slot_mapping.cpu())
    torch.testing.assert_close(kc.cpu(), kc_ref, equal_nan=True, atol=0, rtol=0)
    expected = ref.paged_attention(q.cpu(), kc_ref, vc_ref, meta.block_tables.cpu(), meta.cu_seqlens_q.cpu(),
                                   meta.seq_lens.cpu(), 0.125)
    _check(out.cpu(), expected, torch.float32)


def test_kernel_config_validates_tiles():
    assert tri.kernel_config(64, 64, 32, 8, 128)["tile_q"] == 4         # decode: 4 tokens x 4 heads = 16 rows
    assert tri.kernel_config(4096, 1, 32, 8, 128)["tile_q"] == 32       # prefill: 128 rows
    assert tri.kernel_config(2112, 65, 32, 8, 128)["tile_q"] == 16      # mixed: 64 rows
    assert tri.kernel_config(100, 3, 6, 2, 80)["tile_q"] == 16          # G = 3 padded to 4
    with pytest.raises(ValueError, match="16"):
        tri.kernel_config(10, 10, 4, 4, 64, tile_q=4)                    # 4 rows: too few for tl.dot
    with pytest.raises(ValueError, match="tile_n"):
        tri.kernel_config(10, 10, 4, 4, 64, tile_n=8)
    assert tri.choose_num_splits(1, 1, 8, torch.device("cpu")) == 1


def test_kernels_compile_for_h200():
    """No GPU needed: compile every kernel for sm_90a with triton's bundled toolchain (catches what the
    interpreter accepts but the compiler does not: dot shapes, layouts, early returns, constexpr misuse)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, os.path.join(root, "experiments", "kernels_gpu.py"), "--compile-only"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and ("nvidia" in proc.stderr.lower() and "backend" in proc.stderr.lower()):
        pytest.skip(f"triton's nvidia backend is unavailable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)["compile_only"]
    assert {r["kernel"] for r in results} == {"paged_attention", "merge", "write_kv_cache"}
    for r in results:
        if r["kernel"] == "paged_attention" and r["what"].startswith(("decode bf16", "mixed bf16", "prefill bf16")):
            assert r["pipelined_cp_async"], r
            if r.get("spill_store_bytes") is not None:  # only when a bundled ptxas could report it
                assert r["spill_store_bytes"] == 0, r
        if r["what"].startswith("prefill bf16"):
            assert r["uses_wgmma"], r
