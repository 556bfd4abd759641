"""A Mamba2 mixer (Nemotron-H's `M` layers, Granite 4.0's `mamba` layers) over a flattened step.

in-projection [z | x B C | dt] -> causal conv of x B C (carried window) -> SSD scan (carried state, ssd_scan.py)
-> y * silu(z), RMS-normed per group -> out-projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.core.state_cache import StateShape
from worker_svc.model.layers.causal_conv import causal_conv1d
from worker_svc.model.layers.recurrent_split import RecurrentSplit
from worker_svc.model.layers.ssd_scan import ssd_scan


@dataclass(frozen=True)
class Mamba2Dims:
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    time_step_min: float = 0.0  # dt is clamped below at this (transformers' time_step_limit in the scan)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # x, B and C go through the conv together
        return self.inner + 2 * self.groups * self.state_size

    def state_shape(self, num_layers: int) -> StateShape:
        return StateShape(num_layers, (self.conv_dim, self.conv_kernel - 1),
                          (self.heads, self.head_dim, self.state_size))


@dataclass
class Mamba2Weights:
    in_proj: torch.Tensor  # [inner + conv_dim + heads, hidden]
    conv: torch.Tensor  # [conv_dim, kernel]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor  # [heads] float32
    a: torch.Tensor  # [heads] float32: -exp(A_log)
    d: torch.Tensor  # [heads] float32
    norm: torch.Tensor  # [inner] float32
    out_proj: torch.Tensor  # [hidden, inner]


def mamba2_mixer(x: torch.Tensor, w: Mamba2Weights, dims: Mamba2Dims, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, eps: float,
                 linear: Callable[..., torch.Tensor], conv: Callable[..., torch.Tensor] = causal_conv1d,
                 scan: Callable[..., torch.Tensor] = ssd_scan,
                 split: RecurrentSplit | None = None) -> torch.Tensor:
    """The layer's output [T, hidden] for its normed input x [T, hidden]; conv_states [S, conv_dim, K - 1] and
    ssm_states [S, heads, head_dim, state_size] are read at `slots` and updated. `linear`, `conv` and `scan`: the
    model's ops (Linear, CausalConv1d, SSDScan) or the plain torch functions; `split`: the step's
    (StateStep.split), so that no layer reads cu_seqlens back to branch."""
    t = x.shape[0]
    gn = dims.groups * dims.state_size
    z, xbc, dt = linear(x, w.in_proj).split([dims.inner, dims.conv_dim, dims.heads], dim=-1)
    xbc = conv(xbc, w.conv, w.conv_bias, conv_states, slots, cu_seqlens)
    xs, b, c = xbc.split([dims.inner, gn, gn], dim=-1)
    dt = F.softplus(dt.float() + w.dt_bias).clamp(min=dims.time_step_min)
    y = scan(xs.view(t, dims.heads, dims.head_dim), dt, w.a, b.view(t, dims.groups, dims.state_size),
             c.view(t, dims.groups, dims.state_size), w.d, ssm_states, slots, cu_seqlens, split)
    # Gate, then RMS-normalise each of the `groups` slices of the inner dimension, in float32.
    y = y.reshape(t, dims.groups, -1) * F.silu(z.float()).view(t, dims.groups, -1)
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).reshape(t, dims.inner)
    return linear((w.norm * y).to(x.dtype), w.out_proj)
