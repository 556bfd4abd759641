"""Gated activations of the MLP: silu(gate) * up (SwiGLU: Llama, Qwen, Mistral) and gelu_tanh(gate) * up (GeGLU:
Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from worker_svc.model.layers.op import LayerOp


class SiluAndMul(LayerOp):
    """silu(gate) * up; eager it overwrites `gate` (two fewer allocations), traced it makes a new tensor."""

    def __init__(self, mode: str):
        super().__init__(mode)
        self.ops = cpu_ops.load() if mode == "cpu" else None

    def forward_native(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def forward_cuda(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate, inplace=True).mul_(up)

    def forward_cpu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and gate.dtype == torch.bfloat16 and gate.dim() == 2:
            self.ops.silu_mul_(gate, up)  # torch's two ops in one pass, same roundings
            return gate
        return self.forward_cuda(gate, up)


class GeluTanhAndMul(LayerOp):
    """gelu(gate, tanh approximation) * up, into `gate` eager."""

    def forward_native(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def forward_cpu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh").mul_(up)

    forward_cuda = forward_cpu
