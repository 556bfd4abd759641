"""gpt-oss's mixture-of-experts block as pure torch functions.

It differs from the Mixtral-style block (layers/moe.py) in three places, each as transformers' GptOssMLP computes:
- the router has a bias, and the softmax runs over the top-k logits only (in the activations' dtype);
- every expert projection has a bias;
- the activation is a clamped SwiGLU: gate clamped above at `limit`, up clamped to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate).

Expert weights are per expert, [out, in] like any matmul weight here: `gate_up[e]` [2 * I, hidden] (the gate rows,
then the up rows: the checkpoint's interleaved columns are split at load), `down[e]` [hidden, I]. Each may be dense,
CPU-prepacked, or an MXFP4 tile (worker_svc/model/mxfp4.py) dequantized to the activations' dtype right before its
matmul. The loop runs over experts, never over tokens: the (token, slot) pairs are grouped by expert first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from worker_svc.model.layers.linear import linear
from worker_svc.model.layers.moe import per_expert_grouped
from worker_svc.model.mxfp4 import Mxfp4Weight


@dataclass
class ClampedSwiGLUExperts:
    """One layer's block."""

    router: Tensor  # [E, hidden]
    router_bias: Tensor  # [E]
    gate_up: list[Any]  # E matmul weights [2 * I, hidden]: dense, prepacked or Mxfp4Weight
    gate_up_bias: Tensor  # [E, 2 * I]: gate biases, then up biases
    down: list[Any]  # E matmul weights [hidden, I]
    down_bias: Tensor  # [E, hidden]
    top_k: int
    alpha: float
    limit: float

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def route(x: Tensor, router: Tensor, bias: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k] in x's dtype, expert ids [T, top_k]): softmax over each token's top-k router logits."""
    logits = torch.nn.functional.linear(x, router, bias)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _matmul(x: Tensor, weight: Any, bias: Tensor) -> Tensor:
    """x @ weight.T, then + bias (two roundings, as transformers' matmul then add)."""
    if isinstance(weight, Mxfp4Weight):  # this expert's tile only, exact in x's dtype
        weight = weight.dequantize(x.dtype)
    return linear(x, weight) + bias


def experts_forward(x: Tensor, w: ClampedSwiGLUExperts) -> Tensor:
    """The block's output for x [T, hidden] (post-attention-normed), in x's dtype."""
    weights, ids = route(x, w.router, w.router_bias, w.top_k)

    def clamped_expert(e: int, rows: Tensor) -> Tensor:
        gate, up = _matmul(rows, w.gate_up[e], w.gate_up_bias[e]).chunk(2, dim=-1)
        return _matmul(clamped_swiglu(gate, up, w.alpha, w.limit), w.down[e], w.down_bias[e])

    out, order, token = per_expert_grouped(x, ids, w.num_experts, clamped_expert)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    # Pairs arrive in expert order, so each token sums its experts' outputs in ascending expert order (as transformers).
    return torch.zeros_like(x).index_add_(0, token, out)
