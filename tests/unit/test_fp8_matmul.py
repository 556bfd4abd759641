"""The CPU FP8 weight-only matmul (kernels/csrc/quant_matmul.cpp's `fp8_matmul`, what quant.QuantLinear runs for an
HF FP8 checkpoint's projections) against dequantize-then-matmul on random tensors: every float8_e4m3fn code read
exactly (subnormals included), each scale layout (128 x 128 and 64 x 64 blocks, per channel, per tensor) at 1 to 33
rows with N and K not multiples of the block, float32 and bfloat16 activations; a row's result independent of its
batch; the residual add; bad operands refused naming them."""

from __future__ import annotations

import pytest
import torch

from tests.support.cpu_tiers import kernel_test_tiers, tier_ops
from worker_svc.model import quant
from worker_svc.model.hf_quant import fp8_weight

FP8_MAX = 448.0


@pytest.fixture(params=kernel_test_tiers(lowest="x86-64-v3"))
def ops(request, monkeypatch):
    """The kernels built for one ISA tier from x86-64-v3 on (tests/support/cpu_tiers.py), the process's default."""
    module = tier_ops(request.param, monkeypatch)
    assert hasattr(module, "fp8_matmul"), "fp8_matmul needs AVX2 + FMA + F16C: absent from this build?"
    return module


def random_fp8(out: int, inp: int, layout: str, seed: int = 0) -> quant.QuantizedWeight:
    """Random codes (every finite magnitude likely) and positive scales in `layout`: block128, block64, channel,
    tensor; as hf_quant.fp8_weight reads them from a checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(out, inp, generator=gen) * 60).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if layout.startswith("block"):
        b = int(layout.removeprefix("block"))
        scale = torch.rand(-(-out // b), -(-inp // b), generator=gen) + 1e-3
        return fp8_weight(codes, scale, "w", (b, b))
    rows = 1 if layout == "tensor" else out
    return fp8_weight(codes, torch.rand(rows, 1, generator=gen) + 1e-3, "w")


def test_every_finite_code_is_read_exactly(ops):
    """One-hot rows pick each weight: all 254 finite float8_e4m3fn codes (0x7f / 0xff are NaN) come out as torch's
    own float32 conversion, times scales that are and are not powers of two."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)]).view(1, 256)
    for s in (1.0, 0.3, 2.0 ** -20, 1e30):
        scale = torch.full((1, 1), s)
        y = ops.fp8_matmul(torch.eye(256), codes.view(torch.float8_e4m3fn), scale, 256)
        assert torch.equal(y[:, 0], codes.view(torch.float8_e4m3fn).float()[0] * scale[0, 0]), s


@pytest.mark.parametrize("layout", ["block128", "block64", "channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_matmul_equals_dequantize_then_matmul(ops, layout, dtype):
    """N = 200 and K = 352 (partial blocks at both ends); every row count 1..33 runs its 4-row tiles and the rest:
    float32 within float32 summation order of the float64 product of the dequantized weight, bfloat16 one rounding
    of it."""
    w = random_fp8(200, 352, layout)
    dense = w.dequantize(torch.float32)
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 34):
        x = torch.randn(rows, 352, generator=gen).to(dtype)
        y = ops.fp8_matmul(x, w.codes, w.scale, w.group)
        ref = x.double() @ dense.double().T
        assert y.dtype == dtype and y.shape == (rows, 200)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
        else:
            # one rounding of the float32 result; an output near zero keeps float32's step at the largest ones
            torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=2 ** -7,
                                       atol=1e-6 * float(ref.abs().max()))
    last = x[-1:].clone()  # a row's result does not depend on the rest of the batch (the tile it lands in)
    assert torch.equal(ops.fp8_matmul(x, w.codes, w.scale, w.group)[-1:],
                       ops.fp8_matmul(last, w.codes, w.scale, w.group))


def test_the_residual_add_inside_the_kernel_equals_a_separate_add(ops):
    w = random_fp8(96, 256, "block128")
    x, residual = torch.randn(5, 256), torch.randn(5, 96)
    want = residual + ops.fp8_matmul(x, w.codes, w.scale, w.group)
    assert torch.equal(ops.fp8_matmul(x, w.codes, w.scale, w.group, residual.clone()), want)


def test_quant_linear_keeps_an_fp8_weight_one_byte_a_value(ops):
    """quant.QuantLinear on the CPU holds the codes (as bytes) and the scales, and runs the kernel: the same bits."""
    w = random_fp8(160, 320, "block128")
    lin = quant.QuantLinear(w, torch.bfloat16, torch.device("cpu"))
    assert lin.ops is not None and lin.fp8 is None and lin.codes.dtype == torch.uint8
    assert lin.codes.nbytes + lin.scale.nbytes < 1.1 * w.codes.numel()
    x = torch.randn(3, 320).to(torch.bfloat16)
    assert torch.equal(lin(x), ops.fp8_matmul(x, w.codes, w.scale, w.group))
    assert torch.equal(lin(x.view(1, 3, 320)), lin(x).view(1, 3, 160))  # any leading dims


def test_weights_the_kernel_cannot_take_are_named(ops):
    """K not whole 32-groups, or a block whose width is not 32 x 2^k, stays with the loader (dequantized there:
    quant.fp8_kernel_takes); the op itself refuses them naming the operand."""
    assert quant.fp8_kernel_takes(random_fp8(64, 256, "block128"))
    assert quant.fp8_kernel_takes(random_fp8(64, 200, "channel")) is False  # 200 columns: not whole 32-groups
    assert quant.fp8_kernel_takes(random_fp8(64, 256, "block96")) is False
    assert quant.fp8_kernel_takes(random_fp8(64, 96, "block96"))  # one block covers all columns: per channel
    x = torch.randn(2, 256)
    codes = random_fp8(64, 256, "block128").codes
    with pytest.raises(RuntimeError, match="group must be 32 times a power of two"):
        ops.fp8_matmul(x, codes, torch.ones(64, 3), 96)
    with pytest.raises(RuntimeError, match=r"scale must be \[N, ceil\(K / group\)\]"):
        ops.fp8_matmul(x, codes, torch.ones(64, 3), 128)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.fp8_matmul(torch.randn(2, 200), codes[:, :200].contiguous(), torch.ones(64, 1), 200)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 256\]"):
        ops.fp8_matmul(torch.randn(2, 128), codes, torch.ones(64, 2), 128)
