"""MXFP4 weights (gpt-oss's experts, OCP Microscaling FP4): kept packed, dequantized per expert in its matmul.

The checkpoint stores each expert projection as `*_blocks` uint8 [E, out, in / 32, 16] (two e2m1 codes a byte, the
low nibble first) and `*_scales` uint8 [E, out, in / 32] (an e8m0 exponent per 32 values, biased by 127), so a value
is e2m1(code) * 2^(scale - 127). An e2m1 value has 2 significant bits and e8m0 only moves the exponent: every value is
exact in bfloat16 (and float32), so dequantizing one expert's tile to the activations' dtype right before its matmul
gives the checkpoint's values exactly. In memory: 4 bits a value plus a byte per 32 (4.25 bits: ~27% of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The 16 e2m1 values by code: sign bit 3, then exponent and mantissa (OCP MX spec, table of FP4 E2M1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per e8m0 scale
SCALE_BIAS = 127


@dataclass
class Mxfp4Weight:
    """One [out, in] matmul weight: `blocks` uint8 [out, in / 32, 16], `scales` uint8 [out, in / 32]."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        out, groups, _ = self.blocks.shape
        return out, groups * BLOCK

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in `dtype`: exact for float32 and bfloat16 (see the module's note)."""
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.blocks.device)
        codes = torch.stack([self.blocks & 0x0F, self.blocks >> 4], dim=-1)  # [out, G, 16, 2]: low nibble first
        values = lut[codes.long()].reshape(*self.scales.shape, BLOCK)
        exponent = self.scales.to(torch.int32) - SCALE_BIAS
        return torch.ldexp(values, exponent.unsqueeze(-1).float()).reshape(self.shape).to(dtype)

    def to(self, device: torch.device | str) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device))


def check_pair(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError naming the tensor unless `blocks` [E, out, G, 16] and `scales` [E, out, G] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks / {name}_scales must be uint8 (mxfp4); they are {blocks.dtype} / "
                         f"{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}_blocks of shape {tuple(blocks.shape)} and {name}_scales of shape "
                         f"{tuple(scales.shape)} are not mxfp4 blocks [experts, out, in / 32, 16] with one scale "
                         "per block")


def expert_weights(blocks: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None) -> list[Mxfp4Weight]:
    """One Mxfp4Weight per expert of a checkpoint pair, its output rows reordered by `rows` (None: as stored)."""
    if rows is not None:
        blocks, scales = blocks[:, rows], scales[:, rows]
    return [Mxfp4Weight(b.contiguous(), s.contiguous()) for b, s in zip(blocks, scales, strict=True)]
