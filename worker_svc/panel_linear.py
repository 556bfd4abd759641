"""float32 matmul weights packed for the project's C++ kernel (kernels/csrc/dense_matmul.cpp).

The [out, in] matrix is stored as [ceil(out / 16), in, 16]: 16 outputs side by side for every input, the last
panel padded with zeros. On the 2-core AVX2 box the kernel read SmolLM2's weights at 17-27 GB/s at one row, where
oneDNN's prepacked matmul reached 10-19 GB/s, and it was as fast or faster up to 1024 rows (kernels/README.md).
Each (row, output) is summed over the inputs in order in one register lane, whatever the other rows: batch-
invariant by construction.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

PANEL = 16  # outputs per panel (kernels/csrc/dense_matmul.cpp's kPanel)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] contiguous, zero rows appended up to a multiple of 16."""
    n, k = weight.shape
    return F.pad(weight, (0, 0, 0, -n % PANEL)).reshape(-1, PANEL, k).transpose(1, 2).contiguous()


class PanelLinear:
    """A float32 [out, in] CPU weight in panels; `linear` and `linear_add` in worker_svc/model.py call it."""

    dtype = torch.float32

    def __init__(self, weight: torch.Tensor, ops: ModuleType):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PanelLinear takes a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.panels = pack_panels(weight)
        self._matmul = ops.dense_matmul

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias), plus `residual` when given (residual + product, the sum a separate add would give)."""
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features), self.panels, self.out_features, bias,
                         None if residual is None else residual.reshape(-1, self.out_features))
        return y.reshape(*lead, self.out_features)
