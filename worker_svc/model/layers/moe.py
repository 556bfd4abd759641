"""Sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE) as pure torch functions.

A router scores every expert per token (softmax over `gate` logits, in float32), each token keeps its `top_k`
experts (their weights renormalised to sum to 1 where the family says so), and every expert runs its SwiGLU MLP
on the tokens routed to it. The (token, expert) pairs are sorted by expert, so each expert's tokens are one
contiguous slice: one gate/up and one down matmul per expert over that slice (a loop over experts, never over
tokens). The results, scaled by the routing weights, are summed back into their tokens' rows.

Expert weights are stacked per layer: `gate_up` [E, 2 * I, hidden] (gate rows, then up rows) and `down`
[E, hidden, I]. Tensor parallelism splits every expert's intermediate dimension I like the dense MLP's
(`expert_slice`, applied by the loader): each rank computes a partial down projection for every pair and one
all-reduce sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from worker_svc.model.layers.linear import linear


@dataclass
class MoEWeights:
    """One layer's sparse block. `router` is replicated on every rank; `gate_up` and `down` hold this rank's
    slice of each expert's intermediate dimension."""

    router: Tensor  # [E, hidden]
    gate_up: Tensor | list[Tensor]  # [E, 2 * I, hidden]; or E oneDNN-prepacked [2 * I, hidden] (CPU, model.linear)
    down: Tensor | list[Tensor]  # [E, hidden, I]; or E prepacked [hidden, I]
    top_k: int
    norm_topk_prob: bool  # renormalise the kept weights to sum to 1 (Mixtral always; Qwen3-MoE per config)
    # Routing weights kept in float32 up to the scaling of the expert outputs (Mixtral), or rounded to the
    # activation dtype first (Qwen3-MoE): transformers differs between the two, which shows in bfloat16.
    float32_weights: bool = True

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


ExpertsFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def route(x: Tensor, router: Tensor, top_k: int, norm_topk_prob: bool,
          float32_weights: bool = True) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k], expert ids [T, top_k] int64) for tokens x [T, hidden], best expert first."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(x.dtype)), ids


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(order, counts): `order` lists the flattened (token, slot) pairs of ids [T, top_k] grouped by expert
    (stable, so tokens keep their order within an expert); counts[e] is expert e's number of pairs."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def per_expert_grouped(x: Tensor, ids: Tensor, num_experts: int,
                       expert: Callable[[int, Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(out, order, token): expert(e, rows) run once per expert that received tokens, over its contiguous slice of
    the (token, slot) pairs grouped by expert. out [T * top_k, hidden] is in that grouped order; order is
    sort_by_expert's and token[i] the row of x that pair i came from. Shared by every MoE block's torch path."""
    top_k = ids.shape[1]
    order, counts = sort_by_expert(ids, num_experts)
    token = order // top_k
    xs = x[token]  # [T * top_k, hidden], grouped by expert
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host read of the counts
        if n:
            rows = slice(start, start + n)
            out[rows] = expert(e, xs[rows])
            start += n
    return out, order, token


def experts_torch(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor | list[Tensor],
                  down: Tensor | list[Tensor]) -> Tensor:
    """sum over each token's experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): [T, hidden] in x's dtype.

    Two matmuls per expert that received tokens (dense or prepacked weights: oneDNN's prepacked matmul measured
    3-4x faster than F.linear on these small per-expert slices)."""

    def swiglu_expert(e: int, rows: Tensor) -> Tensor:
        gate, up = linear(rows, gate_up[e]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, down[e])

    out, order, token = per_expert_grouped(x, ids, len(gate_up), swiglu_expert)
    # The product takes the weights' dtype first (float32 for Mixtral), then is rounded, as transformers does.
    out = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
    # Pairs arrive in expert order, so each token sums its experts' outputs in ascending expert order.
    return torch.zeros_like(x).index_add_(0, token, out)


def moe_forward(x: Tensor, w: MoEWeights, experts: ExpertsFn = experts_torch) -> Tensor:
    """The block's output for x [T, hidden]; on a tensor-parallel rank a partial sum to all-reduce."""
    weights, ids = route(x, w.router, w.top_k, w.norm_topk_prob, w.float32_weights)
    return experts(x, weights, ids, w.gate_up, w.down)


def select_experts_fn(device: torch.device) -> ExpertsFn:
    """The Triton fused kernel on CUDA, the grouped torch matmuls elsewhere."""
    if device.type == "cuda":
        from kernels.fused_moe import fused_experts

        return fused_experts
    return experts_torch


def stack_experts(gate: list[Tensor], up: list[Tensor], down: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-expert HF matrices ([I, hidden], [I, hidden], [hidden, I]) -> (gate_up [E, 2I, hidden], down
    [E, hidden, I])."""
    gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    return gate_up, torch.stack(down)


def expert_slice(intermediate: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of each expert's intermediate dimension that tensor-parallel `rank` of `size` holds."""
    if intermediate % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the experts' intermediate size "
                         f"{intermediate} (moe_intermediate_size / intermediate_size)")
    n = intermediate // size
    return rank * n, (rank + 1) * n
