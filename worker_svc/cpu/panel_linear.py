"""Matmul weights packed for the project's C++ kernel (kernels/csrc/dense_matmul.cpp), float32 or bfloat16.

float32: the [out, in] matrix is stored as [ceil(out / 16), in, 16], 16 outputs side by side for every input. On the
2-core AVX2 box the kernel read SmolLM2's weights at 17-27 GB/s at one row, where oneDNN's prepacked matmul reached
10-19 GB/s, and it was as fast or faster up to 1024 rows (kernels/README.md).
bfloat16 (AVX-512 CPUs): [ceil(out / 32), ceil(in / 2), 32, 2], 32 outputs side by side for every pair of
inputs, the layout of the `vdpbf16ps` instruction's operands; 1.3-2x oneDNN's bfloat16 matmul at 1-16 rows. Two
16-output halves of 16 pairs are also AMX weight tiles: on a CPU with AMX the kernel sums in those (oneDNN's AMX
matmul had been 3-8x the `vdpbf16ps` tile at 16-256 rows; the AMX tile is 1.4-1.6x oneDNN at 1-16 rows, even at 64).
The last panel (and an odd input's pair) is padded with zeros. Each (row, output) is summed over the inputs in order
in one register lane (or AMX tile element), whatever the other rows: batch-invariant by construction.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

PANEL_WIDTH = {torch.float32: 16, torch.bfloat16: 32}  # outputs per panel (dense_matmul.cpp's kPanel, kPanelBF16)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [ceil(N / 16), K, 16]; bfloat16 [N, K] -> [ceil(N / 32), ceil(K / 2), 32, 2]; contiguous,
    zeros appended up to whole panels (and pairs)."""
    n, k = weight.shape
    width = PANEL_WIDTH[weight.dtype]
    if weight.dtype == torch.float32:
        return F.pad(weight, (0, 0, 0, -n % width)).reshape(-1, width, k).transpose(1, 2).contiguous()
    padded = F.pad(weight, (0, k % 2, 0, -n % width))
    return padded.reshape(-1, width, (k + 1) // 2, 2).transpose(1, 2).contiguous()


class PanelLinear:
    """A float32 or bfloat16 [out, in] CPU weight in panels; the linear op (worker_svc/model/layers/linear.py) calls
    it."""

    def __init__(self, weight: torch.Tensor, ops: ModuleType):
        if weight.dtype not in PANEL_WIDTH or weight.dim() != 2:
            raise ValueError(f"PanelLinear takes a 2-D float32 or bfloat16 weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.panel_width = PANEL_WIDTH[weight.dtype]
        self.panels = pack_panels(weight)
        self._matmul = ops.dense_matmul

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias), plus `residual` when given (residual + product, the sum a separate add would give: in
        bfloat16 the product is rounded first, then the sum)."""
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features), self.panels, self.out_features, bias,
                         None if residual is None else residual.reshape(-1, self.out_features))
        return y.reshape(*lead, self.out_features)
