"""The base of every layer operation: per-mode implementations, one of them picked once, at load (vLLM's CustomOp).

`forward_native` is plain torch: what the eager forward runs where no kernel applies, and what torch.compile traces
(it must stay traceable: no C++ calls, no in-place writes into its inputs). `forward_cpu` / `forward_cuda` run the
device's kernels where they apply and fall back to torch eager otherwise. A family's forward calls the op and never
asks which mode it is in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NATIVE = "native"  # plain torch, traceable: the compiled forward, and every device without its own kernels
CPU = "cpu"
CUDA = "cuda"


def op_mode(device: torch.device, traced: bool = False) -> str:
    """The mode the ops of a model on `device` run in; `traced`: inside the compiled forward's graphs."""
    if traced:
        return NATIVE
    return device.type if device.type in (CPU, CUDA) else NATIVE


class LayerOp:
    """One layer operation; `self.forward` is the implementation for the mode it was built for."""

    def __init__(self, mode: str = NATIVE):
        self.mode = mode
        self.forward: Callable[..., Any] = {CPU: self.forward_cpu, CUDA: self.forward_cuda}.get(
            mode, self.forward_native)

    def forward_native(self, *args: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any) -> Any:
        return self.forward_native(*args)

    def forward_cuda(self, *args: Any) -> Any:
        return self.forward_native(*args)

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)
