"""Matmuls over panels (worker_svc/cpu/panel_linear.py, kernels/csrc/dense_matmul.cpp), float32 in 16-output panels and
bfloat16 in 32-output panels of input pairs (in the AVX-512 tiers), against torch's matmul in float64 at every
tile shape; batch invariance; the fused bias and residual; bad operands. Once per ISA tier under test from x86-64-v3
on (tests/support/cpu_tiers.py), and the float32 tiles of every tier bit for bit against the AVX2 build's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from tests.support.cpu_tiers import kernel_test_tiers, tier_ops
from worker_svc.cpu.panel_linear import PanelLinear, pack_panels
from worker_svc.model.layers.linear import (
    linear,
    linear_add,
    pack_linear_weight,
    panels_available,
    prepack_linear_weight,
)

TIERS = kernel_test_tiers(lowest="x86-64-v3")  # the matmuls need AVX2 + FMA


@pytest.fixture(scope="module", params=TIERS)
def ops(request):
    """One tier's build, the process's default meanwhile (worker_svc.model's linear loads the kernels itself)."""
    with pytest.MonkeyPatch.context() as mp:
        module = tier_ops(request.param, mp)
        assert panels_available(torch.float32), "kernels/csrc/dense_matmul.cpp needs AVX2 + FMA and a C++ compiler"
        yield module


@pytest.mark.parametrize("rows", [1, 5, 13, 64, 200])
def test_every_tier_sums_float32_panels_to_the_avx2_builds_bits(ops, rows):
    # one lane per (row, output) summing over k in order, whatever the tile: AVX-512's 12-row tiles give AVX2's bits
    torch.manual_seed(rows)
    w, x, bias, res = torch.randn(100, 96), torch.randn(rows, 96), torch.randn(100), torch.randn(rows, 100)
    avx2 = cpu_ops.load("x86-64-v3")
    panels = pack_panels(w)
    for args in ((None, None), (bias, None), (bias, res)):
        assert torch.equal(ops.dense_matmul(x, panels, 100, *args), avx2.dense_matmul(x, panels, 100, *args))


def test_panels_hold_the_matrix_padded_to_16_outputs():
    w = torch.arange(21 * 3, dtype=torch.float32).reshape(21, 3)
    p = pack_panels(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 4], w[20])
    assert not p[1, :, 5:].any()  # the padding is zeros


@pytest.mark.parametrize("out, inp", [(16, 64), (100, 96), (3, 37), (576, 576)])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 64, 200])  # 0: a prefill chunk's head; 200: blocks of rows
def test_product_equals_torch_at_every_tile_shape(ops, out, inp, rows):
    torch.manual_seed(out * rows + inp)
    w, x, bias, res = torch.randn(out, inp), torch.randn(rows, inp), torch.randn(out), torch.randn(rows, out)
    p = PanelLinear(w, ops)
    assert p.shape == (out, inp)
    ref = x.double() @ w.double().T
    tol = dict(rtol=1e-5, atol=1e-5 * inp ** 0.5)
    torch.testing.assert_close(p(x).double(), ref, **tol)
    torch.testing.assert_close(p(x, bias).double(), ref + bias.double(), **tol)
    torch.testing.assert_close(p(x, bias, res).double(), res.double() + ref + bias.double(), **tol)
    # the fused residual is exactly the separate add of the same product
    assert torch.equal(p(x, bias, res), res + p(x, bias))


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(ops):
    torch.manual_seed(0)
    p = PanelLinear(torch.randn(100, 96), ops)
    x = torch.randn(17, 96)
    full = p(x)
    for i in (0, 5, 6, 16):  # first, last and middle of a 6-row tile, and the 1-row tail
        assert torch.equal(full[i], p(x[i:i + 1])[0])
        assert torch.equal(full[i], p(x[i:i + 3])[0])


def test_leading_dimensions_and_strided_inputs(ops):
    torch.manual_seed(1)
    w = torch.randn(40, 32)
    p = PanelLinear(w, ops)
    x = torch.randn(2, 3, 64)[..., ::2]  # not contiguous
    assert p(x).shape == (2, 3, 40)
    torch.testing.assert_close(p(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_model_linear_uses_the_panels_for_float32(ops):
    torch.manual_seed(2)
    w, x, res = torch.randn(24, 32), torch.randn(3, 32), torch.randn(3, 24)
    packed = pack_linear_weight(w)
    assert isinstance(packed, PanelLinear)
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_add(x, packed, None, res.clone()), res + F.linear(x, w), rtol=1e-5, atol=1e-5)
    # bfloat16 panels are built in the AVX-512 tiers (kernels/cpu_isa.py); below them bfloat16 stays with oneDNN
    assert panels_available(torch.bfloat16) == bool(ops.dense_bfloat16) == ("avx512bw" in ops.isa.split())


def test_bad_operands_are_refused_naming_them(ops):
    panels = pack_panels(torch.randn(20, 32))
    with pytest.raises(RuntimeError, match=r"dense_matmul: x must be \[rows, 32\] float32"):
        ops.dense_matmul(torch.randn(2, 48), panels, 20)
    with pytest.raises(RuntimeError, match=r"dense_matmul: x must be \[rows, 32\] float32"):
        ops.dense_matmul(torch.randn(2, 32).bfloat16(), panels, 20)
    with pytest.raises(RuntimeError, match="dense_matmul: panels"):
        ops.dense_matmul(torch.randn(2, 32), panels, 40)  # 40 outputs need 3 panels
    with pytest.raises(RuntimeError, match="dense_matmul: bias"):
        ops.dense_matmul(torch.randn(2, 32), panels, 20, torch.zeros(19))
    with pytest.raises(RuntimeError, match="dense_matmul: residual"):
        ops.dense_matmul(torch.randn(2, 32), panels, 20, None, torch.zeros(3, 20))
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        PanelLinear(torch.randn(4, 4).half(), ops)


@pytest.fixture(scope="module")
def bf16_ops(ops):
    if not ops.dense_bfloat16:
        pytest.skip("bfloat16 panels need an AVX-512 tier")
    return ops


def test_bfloat16_panels_hold_input_pairs_of_32_outputs():
    w = torch.arange(40 * 5, dtype=torch.float32).reshape(40, 5).bfloat16()
    p = pack_panels(w)
    assert p.shape == (2, 3, 32, 2)  # 40 outputs -> 2 panels, 5 inputs -> 3 pairs
    assert torch.equal(p[0, 1, 7], w[7, 2:4]) and torch.equal(p[1, 0, 3], w[35, 0:2])
    assert p[0, 2, 7, 0] == w[7, 4] and p[0, 2, 7, 1] == 0  # the odd input's pair is padded
    assert not p[1, :, 8:].any()


@pytest.mark.parametrize("out, inp", [(32, 64), (100, 97), (3, 37), (576, 576)])
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 17, 64, 200])
def test_bfloat16_product_is_the_rounded_float_sum_at_every_tile_shape(bf16_ops, out, inp, rows):
    torch.manual_seed(out * rows + inp)
    w, x = torch.randn(out, inp).bfloat16(), torch.randn(rows, inp).bfloat16()
    bias, res = torch.randn(out), torch.randn(rows, out).bfloat16()
    p = PanelLinear(w, bf16_ops)
    assert p.shape == (out, inp) and p.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    # one rounding to bfloat16 (2^-9 relative) of a float32 sum (exact products)
    tol = dict(rtol=2 ** -8, atol=1e-5 * inp ** 0.5)
    y = p(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(p(x, bias).double(), ref + bias.double(), **tol)
    # the fused residual is exactly torch's separate add of the rounded product
    assert torch.equal(p(x, bias, res), res + p(x, bias))


def test_bfloat16_rows_do_not_depend_on_the_rest_of_the_batch(bf16_ops):
    torch.manual_seed(3)
    p = PanelLinear(torch.randn(1000, 96).bfloat16(), bf16_ops)  # enough panels for one block of rows
    x = torch.randn(59, 96).bfloat16()
    full = p(x)
    # the edges of 6-row (AVX-512) tiles and of AMX's 32-row tall tiles (rows 0-31, then a 27-row one), the tail
    for i in (0, 5, 6, 15, 16, 31, 32, 47, 48, 58):
        assert torch.equal(full[i], p(x[i:i + 1])[0])  # a wide AMX tile of one row
        assert torch.equal(full[i], p(x[i:i + 3])[0])
        assert torch.equal(full[i], p(x[max(0, i - 20):i + 1])[-1])  # a tall one of 17-21 rows


def test_a_cpu_with_amx_sums_the_bfloat16_panels_in_amx_tiles(bf16_ops):
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert bf16_ops.dense_bfloat16_amx == ("amx_bf16" in flags and "amx_tile" in bf16_ops.isa.split())


def test_onednn_and_the_bfloat16_panels_take_turns(bf16_ops):
    """Both may use AMX tiles on the same threads: each leaves the other's tile configuration as it found it."""
    torch.manual_seed(6)
    w, x = torch.randn(256, 576).bfloat16(), torch.randn(40, 576).bfloat16()
    packed, p = prepack_linear_weight(w), PanelLinear(w, bf16_ops)
    onednn = [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") for _ in range(2)]
    panels = p(x)
    onednn.append(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    assert all(torch.equal(o, onednn[0]) for o in onednn) and torch.equal(p(x), panels)
    torch.testing.assert_close(panels.float(), onednn[0].float(), rtol=2 ** -7, atol=1e-2)


def test_model_linear_uses_bfloat16_panels(bf16_ops):
    torch.manual_seed(4)
    w, x, res = torch.randn(64, 48).bfloat16(), torch.randn(3, 48).bfloat16(), torch.randn(3, 64).bfloat16()
    packed = pack_linear_weight(w)
    assert isinstance(packed, PanelLinear)
    exact = F.linear(x.double(), w.double())
    torch.testing.assert_close(linear(x, packed).double(), exact, rtol=2 ** -8, atol=1e-4)
    assert torch.equal(linear_add(x, packed, None, res.clone()), res + linear(x, packed))


def test_bad_bfloat16_operands_are_refused_naming_them(bf16_ops):
    panels = pack_panels(torch.randn(40, 32).bfloat16())
    with pytest.raises(RuntimeError, match=r"dense_matmul: x must be \[rows, 32 or 31\] bfloat16"):
        bf16_ops.dense_matmul(torch.randn(2, 32), panels, 40)
    with pytest.raises(RuntimeError, match=r"dense_matmul: x must be \[rows, 32 or 31\] bfloat16"):
        bf16_ops.dense_matmul(torch.randn(2, 48).bfloat16(), panels, 40)
    with pytest.raises(RuntimeError, match="dense_matmul: bfloat16 panels"):
        bf16_ops.dense_matmul(torch.randn(2, 32).bfloat16(), panels, 80)
    with pytest.raises(RuntimeError, match="dense_matmul: bias must be"):
        bf16_ops.dense_matmul(torch.randn(2, 32).bfloat16(), panels, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="dense_matmul: residual must be"):
        bf16_ops.dense_matmul(torch.randn(2, 32).bfloat16(), panels, 40, None, torch.zeros(2, 40))


@pytest.mark.parametrize("inter, inp", [(64, 64), (96, 63), (1536, 576)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 20, 64, 200])
def test_swiglu_is_the_two_matmuls_and_silu_mul_bit_for_bit(bf16_ops, inter, inp, rows):
    torch.manual_seed(inter + rows)
    gate, up = (PanelLinear((torch.randn(inter, inp) * 0.1).bfloat16(), bf16_ops) for _ in range(2))
    x = (torch.randn(rows, inp) * 3).bfloat16()  # silu's inputs well past both of its bends
    expected = gate(x)
    bf16_ops.silu_mul_(expected, up(x))  # the unfused ops of the C++ layer loop
    both = torch.stack([gate.panels, up.panels], dim=1).flatten(0, 1)  # gate's panel j, then up's
    assert torch.equal(bf16_ops.dense_swiglu(x, both, inter), expected)
    # each half of the interleaved tensor is still its matrix's panels, every other one: the Python loop's gate and up
    for half, matmul in ((both[0::2], gate), (both[1::2], up)):
        assert torch.equal(bf16_ops.dense_matmul(x, half, inter), matmul(x))


def test_bad_swiglu_operands_are_refused_naming_them(bf16_ops):
    both = pack_panels(torch.randn(128, 32).bfloat16())  # 4 panels: gate and up of 64 outputs
    x = torch.randn(2, 32).bfloat16()
    assert bf16_ops.dense_swiglu(x, both, 64).shape == (2, 64)
    with pytest.raises(RuntimeError, match=r"dense_swiglu: bfloat16 panels must be \[2, "):
        bf16_ops.dense_swiglu(x, both, 32)  # 2 panels expected, 4 given
    with pytest.raises(RuntimeError, match=r"dense_swiglu: x must be \[rows, 32 or 31\] bfloat16"):
        bf16_ops.dense_swiglu(x.float(), both, 64)
    with pytest.raises(RuntimeError, match="dense_swiglu: bfloat16 panels"):
        bf16_ops.dense_swiglu(x, pack_panels(torch.randn(128, 32)), 64)  # float32 panels
