"""Rotary position embeddings: the tables (with the config's rope scaling) and the op that applies them."""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels import cpu_ops
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers.op import NATIVE, LayerOp


def rope_inv_freq(config: ModelConfig, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2], float32, with the config's scaling applied (`scaled`)."""
    dim = config.head_dim
    theta = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling if scaled else None
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type == "linear":
        # Position interpolation: pos / factor, folded into the frequencies.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, config, scaling)
    if rope_type == "freq_factors":
        # llama.cpp's form of llama3 scaling: a per-frequency divisor stored in the GGUF.
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: expected linear, llama3, yarn or none")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly between the two.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, config: ModelConfig, scaling: dict) -> torch.Tensor:
    # YaRN: frequencies turning more than beta_fast times over the original context are kept (extrapolated), those
    # turning fewer than beta_slow times are divided by `factor` (interpolated), a linear ramp over the dims between.
    dim, theta = config.head_dim, config.rope_theta
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
    old_len = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # the extrapolated share of each frequency
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The scale YaRN puts on cos and sin (its `attention_factor`, else 0.1 ln(factor) + 1 from its mscales); 1.0
    for every other rope."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def rope_tables(config: ModelConfig, max_position: int, dtype: torch.dtype, device: torch.device,
                theta: float | None = None, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-flipped sin [max_position, head_dim] for rope as x * cos + swap_halves(x) * sin_signed,
    computed in float32 then cast (as HF does per step)."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope_inv_freq(config, theta, scaled))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaled and (factor := rope_attention_factor(config)) != 1.0:  # YaRN: in float32, before the cast (as HF)
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    half = config.head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] along the last dim, in one copy. With sin's first half negated,
    swap_halves(x) * sin == cat(-x2, x1) * sin exactly (only signs move): HF's rotate_half, without the negation."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


class Rotary(LayerOp):
    """Rope of the q and k heads of one step from one pair of tables (cos and sign-flipped sin, [max_position,
    head_dim]): `prepare(positions)` once per step, then the op per layer on qk [T, heads, D]. The op reads the tables
    through the prepared step only, so any Rotary of the same mode applies any table's step."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor, mode: str):
        super().__init__(mode)
        self.cos, self.sin_signed = cos, sin_signed
        self.ops = cpu_ops.load() if mode == "cpu" else None
        if mode == "cpu" and self.ops is None:  # no C++ kernels built: torch's rope
            self.forward = self.forward_native
        self.prepare = self._prepare_cpu if self.ops is not None else self._prepare_native

    def _prepare_native(self, positions: torch.Tensor) -> Any:
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)  # [T, 1, D]: over heads

    def _prepare_cpu(self, positions: torch.Tensor) -> Any:
        return positions.to(torch.int64).contiguous(), self.cos, self.sin_signed

    def forward_native(self, qk: torch.Tensor, step: Any) -> torch.Tensor:
        cos, sin = step
        return qk * cos + swap_halves(qk) * sin

    def forward_cpu(self, qk: torch.Tensor, step: Any) -> torch.Tensor:
        positions, cos, sin = step
        self.ops.rope_(qk, positions, cos, sin)  # in place
        return qk


class PartialRotary(Rotary):
    """Rope of the first `rotary_dim` dims of each head (Qwen3-Next's partial rotary; all of them: Granite), the rest
    kept, from tables [max_position, rotary_dim]; torch's ops in every mode (two products, then their sum, as the
    hybrid families' transformers code rounds), applied to q and k heads one tensor at a time."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor, mode: str):
        super().__init__(cos, sin_signed, NATIVE)
        self.rotary_dim = cos.shape[-1]

    def forward_native(self, x: torch.Tensor, step: Any) -> torch.Tensor:
        if x.shape[-1] == self.rotary_dim:
            return super().forward_native(x, step)
        turned, kept = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat([super().forward_native(turned, step), kept], dim=-1)
