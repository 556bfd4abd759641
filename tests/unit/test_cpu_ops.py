"""The C++ CPU kernels (kernels/csrc/: paged_attention.cpp, elementwise.cpp) against the torch ops they replace, once
per ISA tier under test (tests/support/cpu_tiers.py: the default tier here and one more, each its own build).

Decode attention is checked against the gathered-SDPA path of kernels/reference.py (itself tested against a dense
float64 reference); the elementwise kernels against the torch expressions of worker_svc/model/decoder.py, bit for bit
where the arithmetic is the same and within one bfloat16 rounding step where only the float32 summation order or
the exp approximation differs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_isa, cpu_ops
from kernels.reference import build_reference_plan, paged_attention, write_kv_cache
from tests.support.cpu_tiers import kernel_test_tiers, tier_ops
from worker_svc.model.layers.rotary import swap_halves

TIERS = kernel_test_tiers()

# what each tier's build says it was compiled for (module.cpp's `isa`), beyond plain x86-64
_TIER_ISA = {"x86-64-v2": set(), "x86-64-v3": {"avx2", "fma"}}
_TIER_ISA["x86-64-v4"] = _TIER_ISA["x86-64-v3"] | {"avx512f", "avx512bw", "avx512vl"}
_TIER_ISA["x86-64-v4-vnni"] = _TIER_ISA["x86-64-v4"] | {"avx512_vnni"}
_TIER_ISA["x86-64-v4-bf16"] = _TIER_ISA["x86-64-v4-vnni"] | {"avx512_bf16"}
_TIER_ISA["x86-64-v4-amx"] = _TIER_ISA["x86-64-v4-bf16"] | {"amx_tile", "amx_bf16"}


@pytest.fixture(params=TIERS)
def ops(request, monkeypatch):
    """One tier's build; paged_attention's kernel rows run it too (the tier is the process's default meanwhile)."""
    return tier_ops(request.param, monkeypatch)


def test_kernels_are_built_here():
    # CI builds them (scripts/setup.sh); a machine where they silently failed would test only the torch paths.
    assert cpu_ops.load() is not None, "kernels/csrc did not build: see the warning logged by kernels.cpu_ops"
    if not os.environ.get("LLMSERVE_TEST_CPU_ISAS"):  # by default the tier loaded here and one more run
        assert cpu_ops.tier().name in TIERS and len(TIERS) >= min(2, len(cpu_ops.runnable_tiers())), TIERS


def test_each_tier_is_built_for_its_own_target(ops):
    tier = cpu_ops.tier().name  # the fixture's (LLMSERVE_CPU_ISA)
    assert set(ops.isa.split()) == {"x86-64"} | _TIER_ISA[tier], (tier, ops.isa)
    assert set(_TIER_ISA) == set(cpu_isa.NAMES)
    # the matmuls and the layer loop need AVX2 + FMA: absent below x86-64-v3, present from it on
    assert hasattr(ops, "dense_matmul") == hasattr(ops, "DecoderLayers") == ("avx2" in ops.isa)


def test_a_build_left_locked_by_a_killed_process_still_loads(tmp_path):
    # A process killed while torch's builder held its lock file leaves the file behind; loading must not wait on it.
    home = tmp_path / "home"
    copy = home / cpu_ops.build_dir().relative_to(Path.home())
    shutil.copytree(cpu_ops.build_dir(), copy)
    (copy / "lock").touch()
    code = "from kernels import cpu_ops; import sys; sys.exit(cpu_ops.load() is None)"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(cpu_ops.__file__).parents[1],
                          env={**os.environ, "HOME": str(home)}, timeout=300)
    assert done.returncode == 0


def test_the_build_does_not_name_the_checkout():
    # Two checkouts of the same sources share one build directory (keyed by content); a build whose ninja file
    # names one checkout's paths would be rebuilt by the other, and a load would wait minutes for it.
    assert str(Path(cpu_ops.__file__).parent) not in (cpu_ops.build_dir() / "build.ninja").read_text()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    assert not cpu_ops.enabled()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|difference| in units of the last place of bfloat16 (monotone bit patterns of finite values)."""
    def key(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)
    return (key(a) - key(b)).abs()


def _case(dtype, head_dim, num_heads, num_kv_heads, query_lens, seq_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = max_blocks * len(seq_lens) + 3
    kc = torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g).to(dtype)
    # shuffled blocks: the kernel follows the table, not the pool's order
    tables = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables.int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4), (80, 6, 2)])
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 7}, {"sliding_window": 1}, {"sliding_window": 200},
                                   {"softcap": 5.0}, "sinks"])
def test_decode_attention_matches_the_gathered_sdpa_path(ops, dtype, head_dim, num_heads, num_kv_heads, extra):
    # decodes of many lengths (1, a block's worth, past several blocks) mixed with prefill chunks: short ones (the
    # kernel's, row by row) and one past KERNEL_PREFILL_MAX_CONTEXT (SDPA's)
    query_lens = [1, 5, 1, 1, 3, 1, 1, 40]
    seq_lens = [20, 30, 1, 100, 3, 47, 16, 300]
    q, kc, vc, tables = _case(dtype, head_dim, num_heads, num_kv_heads, query_lens, seq_lens)
    if extra == "sinks":
        extra = {"sinks": torch.randn(num_heads)}
    cu = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(kernel: bool, dt: torch.dtype) -> torch.Tensor:
        plan = build_reference_plan(tables, query_lens, seq_lens, 16, decode_kernel=kernel)
        assert (plan.kernel_rows is not None) == kernel
        return paged_attention(q.to(dt), kc.to(dt), vc.to(dt), tables, cu, lens, head_dim ** -0.5, plan=plan,
                               **extra).float()

    kernel_rows = build_reference_plan(tables, query_lens, seq_lens, 16, decode_kernel=True).kernel_rows.rows
    assert len(kernel_rows) == sum(query_lens) - 40  # all but the long prompt's chunk
    exact = run(False, torch.float32)[kernel_rows]  # the SDPA path on the same values in float32
    got = run(True, dtype)[kernel_rows]
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    else:  # float32 scores and sums, rounded once to bfloat16 at the end: no worse than SDPA in bfloat16
        err, sdpa_err = (got - exact).abs(), (run(False, dtype)[kernel_rows] - exact).abs()
        assert bool((err <= exact.abs() * 2 ** -8 + 1e-6).all()) and float(err.max()) <= float(sdpa_err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4)])
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 7, "sinks": True}])
def test_decode_attention_is_the_same_bits_whatever_the_batch_and_threads(ops, dtype, head_dim, num_heads,
                                                                          num_kv_heads, extra):
    # The kernel splits its work by whole decodes, KV heads or query heads depending on how many decodes there are
    # and how many threads: a decode's output must not depend on that split.
    seq_lens = [37, 1, 100, 16, 64, 5, 200, 48]
    q, kc, vc, tables = _case(dtype, head_dim, num_heads, num_kv_heads, [1] * len(seq_lens), seq_lens)
    sinks = torch.randn(num_heads) if extra.get("sinks") else None
    window = extra.get("sliding_window", 0)

    def attend(seqs: list[int]) -> torch.Tensor:
        out = torch.zeros_like(q)
        ops.decode_attention(q, torch.tensor(seqs), kc, vc, tables[seqs].contiguous(),
                             torch.tensor([seq_lens[s] for s in seqs], dtype=torch.int32), head_dim ** -0.5, window,
                             0.0, sinks, out)
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = attend(list(range(len(seq_lens))))
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for size in (1, 2, 3, len(seq_lens)):
                for first in range(0, len(seq_lens) - size + 1, size):
                    seqs = list(range(first, first + size))
                    assert torch.equal(attend(seqs)[seqs], want[seqs]), (n, seqs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 8, 2), (64, 32, 8), (64, 16, 1),
                                                            (32, 4, 4)])
def test_a_rows_attention_is_the_same_bits_as_a_decode_in_a_prefill_chunk_or_a_draft(ops, dtype, head_dim,
                                                                                     num_heads, num_kv_heads):
    # With AMX, the rows of one sequence share key tiles (16 rows of a head, or a decode's heads, per tile): a row's
    # output must not depend on which rows it shares them with, however a prompt is chunked.
    rows = 45  # blocks of 16, 16 and 13 rows
    seq_lens = [70, 130, 25]  # the long one's last `rows` positions are the chunk
    q, kc, vc, tables = _case(dtype, head_dim, num_heads, num_kv_heads, [rows, 1, 1], seq_lens, seed=4)
    chunk_lens = list(range(seq_lens[1] - rows + 1, seq_lens[1] + 1))

    def attend(parts: list[tuple[int, int]]) -> torch.Tensor:
        """the chunk's rows [a, b) of each part as one call each, with the two decodes in the same call"""
        out = torch.zeros_like(q)
        for a, b in parts:
            token_rows = [*range(a, b), rows, rows + 1]
            seqs = [1] * (b - a) + [0, 2]
            lens = [*chunk_lens[a:b], seq_lens[0], seq_lens[2]]
            ops.decode_attention(q, torch.tensor(token_rows), kc, vc, tables[seqs].contiguous(),
                                 torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5, 0, 0.0, None, out)
        return out

    want = attend([(0, rows)])
    for parts in ([(i, i + 1) for i in range(rows)], [(0, 7), (7, 20), (20, 45)], [(0, 3), (3, 44), (44, 45)]):
        got = attend(parts)
        assert torch.equal(got[:rows], want[:rows]), parts
    assert torch.equal(attend([(0, 1)])[rows:], want[rows:])  # the decodes, whatever shares their call


def test_bfloat16_attention_takes_amx_tiles_where_the_cpu_has_them(ops):
    # only an AMX tier's build has the tile path (and below x86-64-v3 the module lacks the flag)
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    amx_build = "amx_tile" in ops.isa.split()
    assert getattr(ops, "attention_bfloat16_amx", False) == (amx_build and "amx_bf16" in flags and "amx_tile" in flags)


def test_bfloat16_attention_with_32_position_blocks_matches_sdpa(ops):
    # a 32-position block holds two key tiles (the tiles take 16 positions at a time, from inside a block)
    g = torch.Generator().manual_seed(5)
    bs, query_lens, seq_lens = 32, [1, 20, 1], [75, 60, 1]
    kc = torch.randn(12, bs, 3, 64, generator=g).bfloat16()
    vc = torch.randn(12, bs, 3, 64, generator=g).bfloat16()
    tables = torch.randperm(12, generator=g)[:9].view(3, 3).int()
    q = torch.randn(sum(query_lens), 9, 64, generator=g).bfloat16()
    cu = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(kernel: bool, dt: torch.dtype) -> torch.Tensor:
        plan = build_reference_plan(tables, query_lens, seq_lens, bs, decode_kernel=kernel)
        return paged_attention(q.to(dt), kc.to(dt), vc.to(dt), tables, cu, lens, 0.125, plan=plan).float()

    exact, got = run(False, torch.float32), run(True, torch.bfloat16)
    assert bool(((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all())


def test_decode_attention_of_an_empty_sequence_is_zero(ops):
    q, kc, vc, tables = _case(torch.float32, 64, 4, 2, [1, 1], [0, 10])
    plan = build_reference_plan(tables, [1, 1], [0, 10], 16, decode_kernel=True)
    out = paged_attention(q, kc, vc, tables, torch.tensor([0, 1, 2], dtype=torch.int32),
                          torch.tensor([0, 10], dtype=torch.int32), 0.125, plan=plan)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(out[1].abs().sum() > 0)


def test_decode_attention_in_the_cache_dtype_when_the_query_differs(ops):
    q, kc, vc, tables = _case(torch.bfloat16, 64, 4, 2, [1, 1], [33, 10])
    args = (kc, vc, tables, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([33, 10], dtype=torch.int32))
    got = paged_attention(q.float(), *args, 0.125, plan=build_reference_plan(tables, [1, 1], [33, 10], 16))
    want = paged_attention(q, *args, 0.125, plan=build_reference_plan(tables, [1, 1], [33, 10], 16))
    assert got.dtype == torch.float32 and torch.equal(got, want.float())


def test_decode_attention_refuses_mismatched_dtypes_naming_them(ops):
    q, kc, vc, tables = _case(torch.float32, 64, 4, 2, [1], [5])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.decode_attention(q, torch.tensor([0]), kc.bfloat16(), vc.bfloat16(), tables,
                             torch.tensor([5], dtype=torch.int32), 0.1, 0, 0.0, None, torch.empty_like(q))


def _composite_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_equals_the_composite_up_to_summation_order(ops):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 576, generator=g) * 3).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    got, want = ops.rms_norm(x, w, 1e-5), _composite_rms_norm(x, w, 1e-5)
    ulps = _ulps(got, want)
    assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.999
    # a strided row view (h[rows] slices) reads its own stride
    assert torch.equal(ops.rms_norm(x[::2], w, 1e-5), ops.rms_norm(x[::2].contiguous(), w, 1e-5))


def test_rms_norm_in_float32_equals_torch_up_to_summation_order(ops):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(300, 576, generator=g) * 3, torch.randn(576, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_the_torch_expression(ops, dtype):
    g = torch.Generator().manual_seed(2)
    num_tokens, heads, dim = 37, 12, 64
    qkv = torch.randn(num_tokens, (heads + 3) * dim, generator=g).to(dtype)
    qk = qkv[:, :heads * dim].view(num_tokens, heads, dim)  # strided, as the model's view of its qkv output
    positions = torch.randint(0, 500, (num_tokens,), generator=g)
    angles = torch.outer(torch.arange(512).float(), torch.rand(dim // 2, generator=g))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin = torch.cat([-sin[:, :dim // 2], sin[:, dim // 2:]], dim=-1)
    want = qk * cos[positions].unsqueeze(1) + swap_halves(qk) * sin[positions].unsqueeze(1)
    ops.rope_(qk, positions, cos, sin)
    assert torch.equal(qk, want)


def test_silu_mul_within_one_rounding_of_torch(ops):
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(64, 1536, generator=g) * 4).bfloat16()
    up = torch.randn(64, 1536, generator=g).bfloat16()
    want = F.silu(gate) * up
    ops.silu_mul_(gate, up)
    ulps = _ulps(gate, want)
    assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_index_copy_and_skips_negative_slots(ops, dtype):
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 2 + 2 * 3, 64, generator=g).to(dtype)  # q heads, then k and v heads, as the model's qkv
    key, value = kv[:, 2:5], kv[:, 5:8]
    slots = torch.tensor([3, -1, 17, 40, 0])
    caches = [torch.zeros(4, 16, 3, 64, dtype=dtype) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)  # the C++ path
    keep = slots >= 0
    for c, src in ((caches[2], key), (caches[3], value)):
        c.view(-1, 3, 64).index_copy_(0, slots[keep], src[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="past the cache"):
        ops.write_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 64]))


def test_float16_caches_run_through_float32_copies():
    # float16 is no CPU serving dtype, but the Triton tests compare against this path in it
    q, kc, vc, tables = _case(torch.float32, 64, 4, 2, [1, 1], [33, 10])
    args = (tables, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([33, 10], dtype=torch.int32), 0.125)
    plan = build_reference_plan(tables, [1, 1], [33, 10], 16)
    half = paged_attention(q.half(), kc.half(), vc.half(), *args, plan=plan)
    full = paged_attention(q.half().float(), kc.half().float(), vc.half().float(), *args, plan=plan)
    assert half.dtype == torch.float16 and torch.equal(half, full.half())
