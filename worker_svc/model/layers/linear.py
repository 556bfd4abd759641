"""The linear op: x @ weight.T (+ bias), and its residual-add form, for every form a matmul weight is held in.

A weight's form is chosen once, at load (`pack_linear_weight`): a dense tensor, the project's CPU panels
(worker_svc/cpu/panel_linear.py), oneDNN's blocked copy, or a quantized weight (worker_svc/model/quant.py). The ops'
native implementation is F.linear on a dense weight (what the compiled forward traces); the CPU and CUDA ones
dispatch on the weight's form.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from worker_svc.cpu.panel_linear import PanelLinear
from worker_svc.model.layers.op import LayerOp
from worker_svc.model.quant import QuantLinear

MatmulWeight = torch.Tensor | PanelLinear | QuantLinear


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX). Without them oneDNN emulates bf16
    and float32 is as fast and more exact."""
    return bool(cpu_ops.cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes float16 natively (AVX512-FP16 or AMX-FP16); without them torch converts every
    float16 operand to float32 and back."""
    return bool(cpu_ops.cpu_flags() & {"avx512_fp16", "amx_fp16"})


def panels_available(dtype: torch.dtype) -> bool:
    """Whether matmuls of `dtype` can run the project's panel kernel (kernels/csrc/dense_matmul.cpp): float32 with
    AVX2 + FMA, bfloat16 in the AVX-512 tiers (`vdpbf16ps` with AVX512-BF16, widened to float32 multiply-adds
    without)."""
    if dtype not in (torch.float32, torch.bfloat16) or (ops := cpu_ops.load()) is None \
            or not hasattr(ops, "dense_matmul"):
        return False
    return dtype == torch.float32 or bool(getattr(ops, "dense_bfloat16", False))


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matmul weights can be packed for the CPU (`pack_linear_weight`): float32 and bfloat16 in the project's
    panels where that kernel is built, else with oneDNN (bfloat16 only on a CPU with native bf16).

    On CPU, F.linear goes to MKL's sgemm, which (measured on an AMD EPYC) runs 2-3x slower than oneDNN for
    the batch sizes a worker sees (8..512 rows); oneDNN also reads its blocked weight layout faster at 1 row
    (bfloat16: the 49152 x 576 head at 1 row 2.4x faster packed than F.linear).
    Set LLMSERVE_PREPACK_LINEAR=0 to turn it off.
    """
    if device.type != "cpu" or os.environ.get("LLMSERVE_PREPACK_LINEAR", "1") == "0":
        return False
    if panels_available(dtype):
        return True
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the ops are internal (TorchInductor's CPU freezing path): check they exist and agree with F.linear
        w = torch.linspace(-1, 1, 24 * 40).reshape(24, 40).sin().to(dtype)  # no global RNG use
        x = torch.linspace(-2, 2, 3 * 40).reshape(3, 40).cos().to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, prepack_linear_weight(w), None, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=tol, atol=tol / 10))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [out, in] float32/bfloat16 CPU weight in oneDNN's blocked layout (`weight.is_mkldnn`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | PanelLinear:
    """A [out, in] CPU weight in the layout its matmul runs fastest from: the project's panels where that kernel is
    built for its dtype (float32: it beat oneDNN at 1 to 1024 rows on SmolLM2's shapes; bfloat16: 1.3-2x at 1-16
    rows, 1.0-1.3x at 64-256), else oneDNN's blocked copy."""
    if panels_available(weight.dtype):
        return PanelLinear(weight, cpu_ops.load())
    return prepack_linear_weight(weight)


def linear(x: torch.Tensor, weight: MatmulWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for a dense, a packed or a quantized weight."""
    if isinstance(weight, PanelLinear):
        return weight(x, bias)
    if isinstance(weight, QuantLinear):
        y = weight(x)
        return y if bias is None else y.add_(bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: MatmulWeight, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T + bias: fused into the matmul for panels (float32 or bfloat16) and for a packed or a
    quantized float32 weight (the same result as a separate add), in place into `residual` otherwise. oneDNN's and
    the quantized kernels' fused add in bfloat16 would round once where Hugging Face rounds the product and then the
    sum (the bfloat16 panel kernel rounds twice, as the separate add does)."""
    if isinstance(weight, PanelLinear):
        return weight(x, bias, residual)
    if isinstance(weight, torch.Tensor) and weight.is_mkldnn and weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    if isinstance(weight, QuantLinear) and bias is None and weight.fuses_residual(x):
        return weight(x, residual)
    return residual.add_(linear(x, weight, bias))


class Linear(LayerOp):
    """x @ weight.T + bias."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def forward_cpu(self, x: torch.Tensor, weight: MatmulWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias)

    forward_cuda = forward_cpu


class LinearAdd(LayerOp):
    """residual + x @ weight.T + bias: a new tensor when traced (no write into a graph's input), fused or in place
    into `residual` eager."""

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, weight, bias)

    def forward_cpu(self, x: torch.Tensor, weight: MatmulWeight, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        return linear_add(x, weight, bias, residual)

    forward_cuda = forward_cpu
