"""What the sparse mixture-of-experts families (Mixtral, Qwen3-MoE) share on top of the Llama-shaped decoder:
config.json's MoE fields, and a feed-forward that runs the MoE block (layers/moe.py) on the layers that are sparse."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from worker_svc.model.decoder import LayerWeights
from worker_svc.model.layers import moe


def moe_fields(cfg: dict, num_experts: int, intermediate: int, norm_topk_prob: bool,
               moe_layers: list[int] | None = None) -> dict[str, Any]:
    """ModelConfig's MoE fields; ValueError naming the config.json field when they do not make a sparse block."""
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"config.json field num_experts / num_local_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"config.json field num_experts_per_tok must be an int in [1, {num_experts}] (the number "
                         f"of experts), got {top_k!r}")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": intermediate,
            "norm_topk_prob": bool(norm_topk_prob), "moe_layers": moe_layers}


class SparseMoE:
    """Mixin before a LlamaModel family: the layers in config.moe_layers (None: all) run a sparse block instead of
    the dense MLP. A family names its checkpoint's tensors with the class attributes."""

    moe_block: ClassVar[str]  # the block's prefix within a layer: "block_sparse_moe." (Mixtral), "mlp." (Qwen3-MoE)
    expert_names: ClassVar[tuple[str, str, str]]  # an expert's gate, up and down projection names
    route_float32: ClassVar[bool]  # routing weights stay float32 up to the scaling (moe.MoEWeights.float32_weights)

    @functools.cached_property
    def experts_fn(self) -> moe.ExpertsFn:
        return moe.select_experts_fn(self.device)

    def _feed_forward_weights(self, i: int, weights: dict, w: Callable, mat: Callable) -> dict[str, Any]:
        c = self.config
        if c.moe_layers is not None and i not in c.moe_layers:
            return super()._feed_forward_weights(i, weights, w, mat)
        p = f"model.layers.{i}.{self.moe_block}"
        gate, up, down = ([w(f"{p}experts.{e}.{name}.weight") for e in range(c.num_experts)]
                          for name in self.expert_names)
        gate_up, down = moe.stack_experts(gate, up, down)  # this rank's slice of every expert (loader)
        if self.prepacked:  # one oneDNN-prepacked matrix per expert (CPU); the fused CUDA kernel wants the stacks
            gate_up, down = [mat(t) for t in gate_up], [mat(t) for t in down]
        return {"moe": moe.MoEWeights(w(p + "gate.weight"), gate_up, down, c.num_experts_per_tok,
                                      c.norm_topk_prob, self.route_float32)}

    def feed_forward(self, i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if layer.moe is None:
            return super().feed_forward(i, layer, h)
        out = moe.moe_forward(self.ops.rms_norm(h, layer.post_norm), layer.moe, self.experts_fn)
        # each rank holds part of every expert's intermediate dimension: the residual joins after the sum
        return h.add_(self.reduce(out))
