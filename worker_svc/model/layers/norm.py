"""RMSNorm ops: Llama's (round, then scale), per-head (Qwen3's q/k norm), Gemma's (scale by 1 + w, round once) and
the hybrid families' (scale in float32, round once)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from worker_svc.model.layers.op import LayerOp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: ModuleType | None = None) -> torch.Tensor:
    """Eager RMSNorm: the C++ kernel for a 2-D float32 / bfloat16 CPU x of the weight's dtype (the torch composite
    in one pass: the same roundings, the float32 sum of squares in another order), else torch's. `ops`: the C++
    module where the caller holds it (no look-up per call); None looks it up."""
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 \
            and x.device.type == "cpu" and (ops := ops or cpu_ops.load()) is not None:
        return ops.rms_norm(x, weight, eps)
    return _torch_rms_norm(x, weight, eps)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused kernel instead of six ops; bit-identical to the composite below in float32.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Statistics in float32 so bf16/fp16 activations don't lose precision; same cast order as HF.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, H, D] with per-head weights [H, D] (q and k heads normalized in one call)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm; `scale` is 1 + w in float32 (any shape broadcasting over x's last dim, e.g. [H, D] for
    per-head norms). Normalized and scaled in float32, rounded to x's dtype once (Llama rounds before scaling)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, scale.shape[-1:], None, eps) * scale
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class RMSNorm(LayerOp):
    """Llama's RMSNorm of x [T, hidden] with weight [hidden]; on CPU the C++ kernel where it applies."""

    def __init__(self, eps: float, mode: str):
        super().__init__(mode)
        self.eps = eps
        self.ops = cpu_ops.load() if mode == "cpu" else None  # looked up once, not per call

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _torch_rms_norm(x, weight, self.eps)

    def forward_cpu(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.ops)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in float32 then rounded (`weight` float32), as the
    hybrid families' transformers code computes its RMSNorm."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class Float32RMSNorm(LayerOp):
    """The hybrid families' RMSNorm (`rms_norm_f32`) of x [..., D] with a float32 weight [D]; torch's ops in every
    mode (the C++ kernel rounds before scaling, as Llama does)."""

    def __init__(self, eps: float, mode: str):
        super().__init__(mode)
        self.eps = eps

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_f32(x, weight, self.eps)
