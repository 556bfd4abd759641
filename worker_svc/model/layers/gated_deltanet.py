"""A Gated DeltaNet layer (Qwen3-Next, Qwen3.5: the `linear_attention` layers) over a flattened step.

in-projection -> causal conv (carried window) -> q, k, v -> gated delta rule (carried matrix) -> gated RMSNorm
-> out-projection. Weights are kept in one fused in-projection whose rows are [q | k | v | z | b | a] (each family
rearranges its checkpoint into that order at load), so the layer runs one matmul in and one out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.core.state_cache import StateShape
from worker_svc.model.layers.causal_conv import causal_conv1d
from worker_svc.model.layers.gated_delta_rule import gated_delta_rule
from worker_svc.model.layers.recurrent_split import RecurrentSplit


@dataclass(frozen=True)
class DeltaNetDims:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:  # q, k and v go through the conv together
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_shape(self, num_layers: int) -> StateShape:
        return StateShape(num_layers, (self.conv_dim, self.conv_kernel - 1),
                          (self.value_heads, self.key_dim, self.value_dim))


@dataclass
class DeltaNetWeights:
    in_proj: torch.Tensor  # [conv_dim + Hv * dv + 2 * Hv, hidden]: q, k, v, z, b, a rows
    conv: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [Hv]
    neg_a: torch.Tensor  # [Hv] float32: -exp(A_log)
    norm: torch.Tensor  # [dv]: the gated RMSNorm's weight
    out_proj: torch.Tensor  # [hidden, Hv * dv]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, statistics and gate in float32, rounded as transformers
    does (the normed x to the activation dtype before the weight)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def deltanet_mixer(x: torch.Tensor, w: DeltaNetWeights, dims: DeltaNetDims, conv_states: torch.Tensor,
                   ssm_states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, eps: float,
                   linear: Callable[..., torch.Tensor], conv: Callable[..., torch.Tensor] = causal_conv1d,
                   rule: Callable[..., torch.Tensor] = gated_delta_rule,
                   split: RecurrentSplit | None = None) -> torch.Tensor:
    """The layer's output [T, hidden] for its normed input x [T, hidden]; conv_states [S, conv_dim, K - 1] and
    ssm_states [S, Hv, dk, dv] (this layer's views of the pool) are read at `slots` and updated. `linear`, `conv`
    and `rule`: the model's ops (Linear, CausalConv1d, GatedDeltaRule) or the plain torch functions; `split`: the
    step's (StateStep.split), so that no layer reads cu_seqlens back to branch."""
    t = x.shape[0]
    hv, dv, dk = dims.value_heads, dims.value_dim, dims.key_dim
    qkv, z, b, a = linear(x, w.in_proj).split([dims.conv_dim, hv * dv, hv, hv], dim=-1)
    qkv = conv(qkv, w.conv, None, conv_states, slots, cu_seqlens)
    q, k, v = qkv.split([dims.key_heads * dk, dims.key_heads * dk, hv * dv], dim=-1)
    beta = b.sigmoid()
    g = w.neg_a * F.softplus(a.float() + w.dt_bias)  # log decay, in float32 (A would overflow in float16)
    o = rule(q.view(t, -1, dk), k.view(t, -1, dk), v.view(t, hv, dv), g, beta, ssm_states, slots, cu_seqlens,
             split).to(x.dtype)
    o = gated_rms_norm(o.reshape(t * hv, dv), z.reshape(t * hv, dv), w.norm, eps)
    return linear(o.view(t, hv * dv), w.out_proj)
