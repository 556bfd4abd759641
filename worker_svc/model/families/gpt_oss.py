"""gpt-oss (GptOssForCausalLM): the Llama-shaped attention with biases, a learned sink logit per head, sliding and
full layers alternating (`layer_types`) and YaRN rope; every layer's feed-forward is a sparse block with a biased
router and clamped-SwiGLU experts (layers/clamped_swiglu_moe.py), its experts bfloat16 or MXFP4 (mxfp4.py).

The checkpoint stacks each layer's experts: `mlp.experts.gate_up_proj` [E, hidden, 2 * I] with the gate and up
columns interleaved (gate at even columns), `down_proj` [E, I, hidden], their `*_bias`; an MXFP4 checkpoint has
`*_blocks` / `*_scales` instead, rows = output features. Both are turned into per-expert [out, in] matrices here,
gate rows first. Its RMSNorms scale in float32 and round once (transformers keeps them float32).

It runs the eager layer ops: its layer is not LlamaModel's, so the fused C++ layer loop declines it and the compiled
forward refuses it (-O0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from worker_svc.model.decoder import DecoderOps, LayerWeights, LlamaModel
from worker_svc.model.families.hf import ROPE_TYPES, windowed_layer_types
from worker_svc.model.families.sparse_moe import moe_fields
from worker_svc.model.layers import clamped_swiglu_moe as experts
from worker_svc.model.layers.activation import SiluAndMul
from worker_svc.model.layers.linear import Linear, LinearAdd
from worker_svc.model.layers.norm import Float32RMSNorm
from worker_svc.model.layers.rotary import Rotary
from worker_svc.model.mxfp4 import check_pair, expert_weights


def _positive(cfg: dict, field: str, default: float) -> float:
    value = cfg.get(field, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json field {field} must be a number > 0, got {value!r}")
    return float(value)


class GptOss(LlamaModel):
    """GptOssForCausalLM."""

    name: ClassVar[str] = "gpt_oss"
    gguf: ClassVar[bool] = False
    gguf_permuted_qk: ClassVar[bool] = False
    rope_types: ClassVar[tuple[str, ...]] = (*ROPE_TYPES, "yarn")
    reads_mxfp4: ClassVar[bool] = True  # the loader passes an mxfp4 checkpoint's packed experts as stored
    tensor_parallel: ClassVar[bool] = False  # its stacked experts and sinks are not sharded yet

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        window = cfg.get("sliding_window")
        n = cfg["num_hidden_layers"]
        # transformers' default when config.json has none: even layers slide, odd layers attend to everything
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        types = windowed_layer_types({**cfg, "layer_types": types}, window)
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ValueError(f"config.json field sliding_window must be an int > 0 for the sliding layers in "
                             f"layer_types, got {window!r}")
        fields = moe_fields(cfg, cfg.get("num_local_experts", cfg.get("num_experts")), cfg["intermediate_size"],
                            norm_topk_prob=True)  # softmax over the kept logits: the weights sum to 1
        return {**fields, "layer_types": types, "sliding_window": window if "sliding_attention" in types else None,
                "swiglu_alpha": _positive(cfg, "swiglu_alpha", 1.702),
                "swiglu_limit": _positive(cfg, "swiglu_limit", 7.0)}

    @classmethod
    def gguf_config(cls, key) -> dict:
        return {}

    def __init__(self, config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attention: Any = None, max_position: int | None = None,
                 prepack: bool | None = None, tp: Any = None):
        if tp is not None and tp.size > 1:
            raise ValueError(f"--tensor-parallel-size {tp.size}: gpt-oss is not sharded yet; run it with "
                             "--tensor-parallel-size 1")
        stray = sorted(n for n in weights if n.endswith("_blocks") and ".mlp.experts." not in n)
        if stray:
            raise ValueError(f"{stray[0]}: only the experts of an mxfp4 checkpoint are read packed (its "
                             "quantization_config.modules_to_not_convert must cover the rest)")
        super().__init__(config, weights, dtype, device, attention, max_position, prepack, tp)

        def norm(name: str) -> torch.Tensor:  # float32: the norms scale in float32, then round (as transformers)
            return weights[name].to(device=self.device, dtype=torch.float32)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm, layer.post_norm = norm(p + "input_layernorm.weight"), norm(
                p + "post_attention_layernorm.weight")
            # one sink logit per query head, joining the softmax's denominator (both attention backends)
            self.attn_kwargs[i]["sinks"] = norm(p + "self_attn.sinks")
        self.norm = norm("model.norm.weight")

    def use_ops(self, mode: str) -> None:
        self.rotaries = [Rotary(self.cos_cache, self.sin_signed_cache, mode)]
        self.ops = DecoderOps(Float32RMSNorm(self.config.rms_norm_eps, mode), Linear(mode), LinearAdd(mode),
                              SiluAndMul(mode), self.rotaries[0])

    def _feed_forward_weights(self, i: int, weights: dict, w: Callable, mat: Callable) -> dict[str, Any]:
        c = self.config
        p = f"model.layers.{i}.mlp."
        inter = c.moe_intermediate_size
        # The gate's and the up projection's outputs interleave (gate at even indices): gate rows first, then up.
        split = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])
        e = p + "experts."
        if e + "gate_up_proj_blocks" in weights:  # MXFP4: packed, rows = output features
            for proj in ("gate_up_proj", "down_proj"):
                check_pair(e + proj, weights[e + proj + "_blocks"], weights[e + proj + "_scales"])
            gate_up = [t.to(self.device) for t in expert_weights(weights[e + "gate_up_proj_blocks"],
                                                                 weights[e + "gate_up_proj_scales"], split)]
            down = [t.to(self.device) for t in expert_weights(weights[e + "down_proj_blocks"],
                                                              weights[e + "down_proj_scales"])]
        else:  # stored [E, in, out]: each expert's transpose is its [out, in] matrix
            gate_up = [mat(t[:, split].T.contiguous()) for t in w(e + "gate_up_proj")]
            down = [mat(t.T.contiguous()) for t in w(e + "down_proj")]
        block = experts.ClampedSwiGLUExperts(
            router=w(p + "router.weight"), router_bias=w(p + "router.bias"), gate_up=gate_up,
            gate_up_bias=w(e + "gate_up_proj_bias")[:, split].contiguous(), down=down,
            down_bias=w(e + "down_proj_bias"), top_k=c.num_experts_per_tok, alpha=c.swiglu_alpha,
            limit=c.swiglu_limit)
        return {"moe": block}

    def feed_forward(self, i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return h.add_(experts.experts_forward(self.ops.rms_norm(h, layer.post_norm), layer.moe))
