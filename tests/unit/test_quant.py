"""GGUF weights kept quantized (worker_svc/model/quant.py): the codes read from each GGUF type against the gguf
package's own dequantization, and the CPU and Triton matmuls against dequantize-then-matmul, on random data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tests.support.cpu_tiers import kernel_test_tiers, tier_ops  # noqa: E402
from worker_svc.model import quant  # noqa: E402
from worker_svc.model.loader import GGUF_TYPES  # noqa: E402

# Byte offsets of each type's float16 fields inside a block (the rest of a block is codes and packed scales).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Every quantized type the loader reads (worker_svc/model/loader.py's GGUF_TYPES less the float ones).
QUANTIZED_TYPES = [t for t in GGUF_TYPES if t not in ("F32", "F16", "BF16")]


@pytest.fixture(params=kernel_test_tiers(lowest="x86-64-v3"))
def tier(request, monkeypatch):
    """kernels/csrc/quant_matmul.cpp built for one ISA tier from x86-64-v3 on (tests/support/cpu_tiers.py), the
    process's default meanwhile: `quant.cpu_kernels()` returns it."""
    return tier_ops(request.param, monkeypatch)


def random_rows(type_name: str, out: int, inp: int, seed: int = 0) -> np.ndarray:
    """GGUF rows of random codes and scales: uint8 [out, bytes per row], finite float16 fields."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out * inp // block, size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        blocks[:, off:off + 2] = rng.uniform(-0.05, 0.05, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(out, -1)


def test_every_quantized_type_the_loader_reads_is_tested():
    assert sorted(F16_FIELDS) == sorted(QUANTIZED_TYPES)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_codes_read_from_gguf_match_its_dequantization(type_name):
    out, inp = 48, 512
    data = random_rows(type_name, out, inp)
    qtype = GGMLQuantizationType[type_name]
    ref = torch.from_numpy(dequantize(data, qtype).reshape(out, inp).astype(np.float32))
    w = quant.from_gguf(data, type_name, (out, inp), lambda d: dequantize(d, qtype))
    if type_name in quant.INT4_TYPES:
        assert w.bits == 4 and int(w.codes.max()) <= 15
        torch.testing.assert_close(w.dequantize(), ref, rtol=1e-6, atol=1e-6)  # the file's values, exactly
    elif type_name == "Q8_0":
        assert w.bits == 8 and w.codes.dtype == torch.int8 and w.scale.shape == (out, inp // 32)
        assert torch.equal(w.dequantize(), ref)  # the file's values, exactly
    else:
        assert w.bits == 8 and w.codes.dtype == torch.int8 and w.scale.shape == (out, inp // 32)
        step = ref.view(out, -1, 32).abs().amax(dim=-1) / 127  # requantized per 32-group: within half a step
        assert bool(((w.dequantize() - ref).abs() <= step.repeat_interleave(32, dim=1) * 0.501 + 1e-12).all())


def test_row_operations_keep_codes_and_scales_together():
    data = random_rows("Q4_1", 64, 64)
    w = quant.from_gguf(data, "Q4_1", (64, 64), None)
    perm = torch.randperm(64)
    torch.testing.assert_close(w.map_rows(lambda r: r[perm]).dequantize(), w.dequantize()[perm])
    both = quant.cat_rows([w, w.map_rows(lambda r: r[:16])])
    torch.testing.assert_close(both.dequantize(), torch.cat([w.dequantize(), w.dequantize()[:16]]))
    torch.testing.assert_close(w.rows(torch.tensor([3, 3, 60]), torch.float32), w.dequantize()[[3, 3, 60]])
    with pytest.raises(ValueError, match="int4 and int8"):
        quant.cat_rows([w, quant.requantize_int8(torch.randn(4, 64), "Q8_0")])


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("kernel,dtype", [("project", torch.float32), ("project", torch.bfloat16),
                                          ("torch", torch.bfloat16)])
def test_cpu_matmul_equals_dequantize_then_matmul(type_name, rows, kernel, dtype, monkeypatch):
    if kernel == "torch":  # where the project's kernels are not built: torch's int4 / int8 weight-packed kernels
        monkeypatch.setattr(quant, "cpu_kernels", lambda: None)
    out, inp = 96, 256
    qtype = GGMLQuantizationType[type_name]
    w = quant.from_gguf(random_rows(type_name, out, inp, seed=rows), type_name, (out, inp),
                        lambda d: dequantize(d, qtype))
    layer = quant.QuantLinear(w, dtype, torch.device("cpu"))
    assert (layer.ops is not None) == (kernel == "project")
    x = torch.randn(rows, inp).to(dtype)
    ref = x.double() @ w.dequantize().double().T
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, out)
    # float32: the file's weights exactly, float32 sums; bfloat16: the output rounded once (torch's kernel also
    # rounds its scales to bfloat16), relative to the size of the result
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 17])
def test_project_kernels_equal_the_dequantized_matmul_at_every_row_count(tier, dtype, rows):
    ops = quant.cpu_kernels()
    assert ops is not None, "the quantized matmuls in kernels/csrc/quant_matmul.cpp need AVX2 + FMA: absent here?"
    torch.manual_seed(rows)
    out, inp = 100, 96  # 100 outputs: a partial block of 32 at the end; 3 groups of 32
    q = torch.randint(0, 16, (out, inp), dtype=torch.uint8)
    w4 = quant.QuantizedWeight(q, torch.rand(out, inp // 32), torch.randn(out, inp // 32), 4, "test")
    w8 = quant.requantize_int8(torch.randn(out, inp), "test")
    x = torch.randn(rows, inp).to(dtype)
    for y, w in ((ops.int4_matmul(x, quant.pack_int4_groups(q), w4.scale, w4.zero), w4),
                 (ops.int8_matmul(x, w8.codes, w8.scale), w8)):
        ref = x.double() @ w.dequantize().double().T
        assert y.dtype == dtype
        if dtype == torch.float32:  # float32 sums: an output near zero keeps float32's step at the largest ones
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
        else:  # one rounding of the float32 result to bfloat16
            torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=2 ** -7, atol=1e-5)
    # a row's result does not depend on the rest of the batch (the tile it lands in)
    last = x[-1:].clone()
    assert torch.equal(ops.int4_matmul(x, quant.pack_int4_groups(q), w4.scale, w4.zero)[-1:],
                       ops.int4_matmul(last, quant.pack_int4_groups(q), w4.scale, w4.zero))
    assert torch.equal(ops.int8_matmul(x, w8.codes, w8.scale)[-1:],
                       ops.int8_matmul(last, w8.codes, w8.scale))


def group_reference(x: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the integer-activation paths make of x [M, K]: per 32-group codes round(x * levels / absmax), the
    step absmax / levels and the float sum, in the same float32 operations as the kernel."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))  # one rounding
    codes = torch.round(g * inv).to(torch.int8 if levels == 127 else torch.int16).view_as(x)
    return codes, (amax / torch.full_like(amax, levels)).squeeze(-1), g.sum(-1)


@pytest.mark.parametrize("bits,levels", [(8, 127.0), (16, 32767.0)])
def test_activations_are_made_integers_per_group_as_stated(tier, bits, levels):
    ops = quant.cpu_kernels()
    torch.manual_seed(bits)
    x = torch.randn(5, 192) * torch.logspace(-3, 2, 192)  # groups of very different sizes
    x[1, 32:64] = 0.0  # an all-zero group: step 0, codes 0
    codes, step, total = ops.quantize_activations(x, bits)
    want_codes, want_step, want_total = group_reference(x, levels)
    assert torch.equal(codes, want_codes) and torch.equal(step, want_step)
    torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-6)  # summed in another order
    assert step[1, 1] == 0 and not codes[1, 32:64].any()
    # every value within half a step of its group's
    back = (codes.double().view(5, -1, 32) * step.double().unsqueeze(-1)).view_as(x)
    assert bool(((back - x.double()).abs() <= step.double().repeat_interleave(32, dim=1) * 0.5001 + 1e-12).all())


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 17])
@pytest.mark.parametrize("inp", [96, 128])  # 128: whole pairs of groups (int8 codes on AVX512-VNNI run by pairs)
def test_integer_activation_matmuls_equal_the_matmul_of_the_quantized_activations(tier, bits, rows, inp):
    """--activation-quantization: the kernel's result is the exact matmul of the activations it quantized (the
    int4 zero term uses the group's float sum), each row's result independent of the batch, and the distance to
    the float matmul within the quantization's own bound."""
    ops = quant.cpu_kernels()
    torch.manual_seed(rows)
    out = 100
    q = torch.randint(0, 16, (out, inp), dtype=torch.uint8)
    w4 = quant.QuantizedWeight(q, torch.rand(out, inp // 32), torch.randn(out, inp // 32), 4, "test")
    w8 = quant.requantize_int8(torch.randn(out, inp), "test")
    x = torch.randn(rows, inp)
    codes, step, total = ops.quantize_activations(x, bits)
    xq = (codes.double().view(rows, -1, 32) * step.double().unsqueeze(-1)).view(rows, inp)
    packed = quant.pack_int4_groups(q)
    y4 = ops.int4_matmul(x, packed, w4.scale, w4.zero, activation_bits=bits)
    scaled = (q.double().view(out, -1, 32) * w4.scale.double().unsqueeze(-1)).view(out, inp)
    want4 = xq @ scaled.T + total.double() @ w4.zero.double().T
    # float32 sums: an output that cancels to near zero keeps an error of float32's step at the largest outputs
    torch.testing.assert_close(y4.double(), want4, rtol=1e-5, atol=1e-6 * float(want4.abs().max()))
    y8 = ops.int8_matmul(x, w8.codes, w8.scale, activation_bits=bits)
    want8 = xq @ w8.dequantize().double().T
    torch.testing.assert_close(y8.double(), want8, rtol=1e-5, atol=1e-6 * float(want8.abs().max()))
    for y, w in ((y4, w4), (y8, w8)):  # |error| <= sum over k of |w| * half the step of x's group
        bound = (step.double().repeat_interleave(32, dim=1) * 0.5) @ w.dequantize().double().abs().T
        assert bool(((y.double() - x.double() @ w.dequantize().double().T).abs() <= bound * 1.0001 + 1e-5).all())
    last = x[-1:].clone()
    assert torch.equal(y4[-1:], ops.int4_matmul(last, packed, w4.scale, w4.zero, activation_bits=bits))
    assert torch.equal(y8[-1:], ops.int8_matmul(last, w8.codes, w8.scale, activation_bits=bits))
    bf16 = ops.int4_matmul(x.bfloat16(), packed, w4.scale, w4.zero, activation_bits=bits)
    assert bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [0, 8, 16])
@pytest.mark.parametrize("inp", [96, 128])
def test_the_residual_add_inside_the_kernel_equals_a_separate_add(tier, bits, inp):
    ops = quant.cpu_kernels()
    torch.manual_seed(bits)
    out, rows = 100, 5
    q = torch.randint(0, 16, (out, inp), dtype=torch.uint8)
    packed, scale, zero = quant.pack_int4_groups(q), torch.rand(out, inp // 32), torch.randn(out, inp // 32)
    w8 = quant.requantize_int8(torch.randn(out, inp), "test")
    x, residual = torch.randn(rows, inp), torch.randn(rows, out)
    for fn, args in ((ops.int4_matmul, (packed, scale, zero)), (ops.int8_matmul, (w8.codes, w8.scale))):
        alone = fn(x, *args, activation_bits=bits)
        assert torch.equal(fn(x, *args, activation_bits=bits, residual=residual), residual + alone)
    with pytest.raises(RuntimeError, match="int4_matmul: residual must be"):
        ops.int4_matmul(x.bfloat16(), packed, scale, zero, residual=residual)
    layer = quant.QuantLinear(quant.QuantizedWeight(q, scale, zero, 4, "test"), torch.float32, torch.device("cpu"))
    assert layer.fuses_residual(x) and torch.equal(layer(x, residual), residual + layer(x))


def test_quant_linear_runs_the_integer_activations_it_is_given():
    torch.manual_seed(0)
    data = random_rows("Q4_1", 64, 128)
    weights = {"w": quant.from_gguf(data, "Q4_1", (64, 128), None), "norm": torch.ones(128)}
    marked = quant.with_integer_activations(weights, 16, torch.device("cpu"))
    assert marked["w"].activation_bits == 16 and marked["norm"] is weights["norm"]
    layer = quant.QuantLinear(marked["w"], torch.float32, torch.device("cpu"))
    x = torch.randn(3, 128)
    ops = quant.cpu_kernels()
    assert torch.equal(layer(x), ops.int4_matmul(x, quant.pack_int4_groups(marked["w"].codes), marked["w"].scale,
                                                 marked["w"].zero, activation_bits=16))
    assert quant.cat_rows([marked["w"], marked["w"]]).activation_bits == 16
    with pytest.raises(ValueError, match="--activation-quantization int8 needs quantized weights"):
        quant.with_integer_activations({"norm": torch.ones(4)}, 8, torch.device("cpu"))


def test_project_kernels_refuse_bad_shapes_naming_the_operand():
    ops = quant.cpu_kernels()
    codes, scale = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1)
    with pytest.raises(RuntimeError, match=r"int4_matmul: x must be \[rows, 32\]"):
        ops.int4_matmul(torch.randn(2, 48), codes, scale, scale)
    with pytest.raises(RuntimeError, match="int4_matmul: scale and zero"):
        ops.int4_matmul(torch.randn(2, 32), codes, torch.zeros(4, 2), scale)
    with pytest.raises(RuntimeError, match="int4_matmul: codes"):
        ops.int4_matmul(torch.randn(2, 32), codes.int(), scale, scale)
    with pytest.raises(RuntimeError, match="int8_matmul: x must be float32 or bfloat16"):
        ops.int8_matmul(torch.randn(2, 32).half(), torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(RuntimeError, match=r"int8_matmul: scale must be \[N, K / 32\]"):
        ops.int8_matmul(torch.randn(2, 32), torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4))
    with pytest.raises(RuntimeError, match="int4_matmul: activation_bits must be 0, 8 or 16"):
        ops.int4_matmul(torch.randn(2, 32), codes, scale, scale, activation_bits=4)
    with pytest.raises(RuntimeError, match="int8_matmul: codes must be .* K a multiple of 32"):
        ops.int8_matmul(torch.randn(2, 16), torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1))


def test_triton_int4_gemm_equals_dequantize_then_matmul():
    from kernels.quant_gemm import int4_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for m, n, k in ((1, 64, 64), (7, 100, 96), (33, 48, 128)):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale, zero = torch.rand(n, k // 32), torch.randn(n, k // 32)
        w = quant.QuantizedWeight(q, scale, zero, 4, "test")
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        x = torch.randn(m, k)
        y = int4_matmul(x.to(device), packed.to(device), scale.to(device), zero.to(device))
        torch.testing.assert_close(y.cpu(), x @ w.dequantize().T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="int4_matmul"):
        int4_matmul(torch.randn(2, 48), torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(4, 1))


def test_activation_dtype_is_checked(monkeypatch):
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        quant.check_activation_dtype(dtype, cpu)
    with pytest.raises(ValueError, match="--dtype float16"):
        quant.check_activation_dtype(torch.float16, cpu)
    monkeypatch.setattr(quant, "cpu_kernels", lambda: None)  # torch's CPU kernels take bfloat16 only
    quant.check_activation_dtype(torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="--dtype float32"):
        quant.check_activation_dtype(torch.float32, cpu)
