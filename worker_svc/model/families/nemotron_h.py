"""Nemotron-H: a stack of single-mixer blocks, each `x + mixer(rmsnorm(x))`, the mixer picked per layer by
`layers_block_type` (or the older `hybrid_override_pattern`: `M` Mamba2, `*` attention, `-` MLP, `E` MoE): Mamba2
(layers/mamba2_mixer.py), attention without rope (positions come from the Mamba2 layers), or an MLP with a
squared-ReLU and no gate. The checkpoint's names are under `backbone.`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker_svc.core.state_cache import StateShape, StateStep
from worker_svc.model.families.hf import require
from worker_svc.model.families.hybrid import HybridModel
from worker_svc.model.layers.mamba2_mixer import Mamba2Dims, Mamba2Weights, mamba2_mixer

PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
HF_TYPES = {"linear_attention": "mamba", "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}


@dataclass
class Block:
    kind: str  # "mamba", "full_attention" or "mlp"
    norm: torch.Tensor  # float32
    w: Any  # Mamba2Weights, (qkv, o) or (up, down)


def mamba2_fields(cfg: dict, groups_field: str = "n_groups", heads_field: str = "mamba_num_heads",
                  head_dim_field: str = "mamba_head_dim", kernel_field: str = "conv_kernel",
                  state_field: str = "ssm_state_size", conv_bias_field: str = "use_conv_bias") -> dict[str, Any]:
    """ModelConfig's Mamba2 fields from config.json (each family names them its own way)."""
    heads, groups = cfg[heads_field], cfg.get(groups_field, 1)
    if heads % groups:
        raise ValueError(f"config.json field {heads_field}={heads} must be a multiple of {groups_field}={groups}")
    require(cfg, "mamba_hidden_act", ("silu",), "silu")
    return {"mamba_num_heads": heads, "mamba_head_dim": cfg[head_dim_field], "ssm_state_size": cfg[state_field],
            "mamba_n_groups": groups, "mamba_conv_kernel": cfg.get(kernel_field, 4),
            "mamba_conv_bias": bool(cfg.get(conv_bias_field, True)), "time_step_min": float(
                cfg.get("time_step_min", 0.001))}


def mamba2_dims(c) -> Mamba2Dims:
    return Mamba2Dims(c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups, c.mamba_conv_kernel,
                      c.time_step_min)


def mamba2_weights(p: str, weights: dict, w, mat, device: torch.device) -> Mamba2Weights:
    """A Mamba2 mixer's weights under prefix `p` (`...mixer.`)."""
    f32 = lambda name: weights[p + name].to(device, torch.float32)  # noqa: E731
    return Mamba2Weights(mat(w(p + "in_proj.weight")), w(p + "conv1d.weight").squeeze(1),
                         w(p + "conv1d.bias") if p + "conv1d.bias" in weights else None, f32("dt_bias"),
                         -f32("A_log").exp(), f32("D"), f32("norm.weight"), mat(w(p + "out_proj.weight")))


class NemotronH(HybridModel):
    """NemotronHForCausalLM."""

    name = "nemotron_h"
    embed_name = "backbone.embeddings.weight"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        if cfg.get("hybrid_override_pattern"):
            pattern = cfg["hybrid_override_pattern"]
            if set(pattern) - set(PATTERN):
                raise ValueError(f"config.json field hybrid_override_pattern={pattern!r} may hold only "
                                 f"{', '.join(PATTERN)}")
            types = [PATTERN[ch] for ch in pattern]
        else:
            given = cfg.get("layers_block_type") or cfg.get("layer_types")
            if not given or set(given) - set(HF_TYPES):
                raise ValueError(f"config.json field layers_block_type must list {', '.join(HF_TYPES)} per layer; "
                                 f"got {given!r}")
            types = [HF_TYPES[t] for t in given]
        if "moe" in types:
            raise ValueError("config.json field layers_block_type / hybrid_override_pattern: Nemotron-H's MoE layers "
                             "('moe', 'E') are not supported yet")
        for field, allowed in (("attention_bias", (False, None)), ("mlp_bias", (False, None)),
                               ("use_bias", (False, None)), ("mamba_proj_bias", (False, None)),
                               ("residual_in_fp32", (False, None)), ("sliding_window", (None,)),
                               ("mlp_hidden_act", ("relu2",))):
            require(cfg, field, allowed, allowed[0])
        return {"layer_types": types, "num_layers": len(types), "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
                "mlp_hidden_act": "relu2", **mamba2_fields(cfg)}

    def state_shape(self) -> StateShape:
        return self.dims.state_shape(len(self.state_index))

    def _build_layers(self, weights: dict, w, mat) -> None:
        c = self.config
        self.dims = mamba2_dims(c)
        self.blocks: list[Block] = []
        for i, kind in enumerate(c.layer_types):
            p = f"backbone.layers.{i}.mixer."
            if kind == "mamba":
                mixer = mamba2_weights(p, weights, w, mat, self.device)
            elif kind == "full_attention":
                mixer = (mat(torch.cat([w(p + f"{x}_proj.weight") for x in "qkv"])), mat(w(p + "o_proj.weight")))
            else:
                mixer = (mat(w(p + "up_proj.weight")), mat(w(p + "down_proj.weight")))
            self.blocks.append(Block(kind, weights[f"backbone.layers.{i}.norm.weight"].to(self.device, torch.float32),
                                     mixer))
        self.norm = weights["backbone.norm_f.weight"].to(self.device, torch.float32)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                state: StateStep) -> torch.Tensor:
        c, ops = self.config, self.ops
        for i, block in enumerate(self.blocks):
            if self.capture is not None:  # an EAGLE-3 head reads some layers' inputs
                self.capture.layer_input(i, h)
            x = ops.rms_norm(h, block.norm)
            if block.kind == "mamba":
                j = self.state_index[i]
                h = h.add_(self.reduce(mamba2_mixer(x, block.w, self.dims, state.cache.conv[j], state.cache.ssm[j],
                                                    state.slots, state.cu_seqlens, c.rms_norm_eps, ops.linear,
                                                    ops.conv, ops.ssd_scan, state.split)))
            elif block.kind == "full_attention":
                h = self._attention(i, x, *block.w, kv_cache[self.kv_index[i]], attn_meta, h)
            else:
                up = ops.linear(x, block.w[0])
                self.add_lora(i, "up", x, up)
                h = self.row_parallel(F.relu(up).square(), block.w[1], h, (i, "down"))
        return h

    def _attention(self, i: int, x: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, kv: torch.Tensor,
                   attn_meta: Any, residual: torch.Tensor) -> torch.Tensor:
        c = self.config
        t, d = x.shape[0], c.head_dim
        qkv = self.ops.linear(x, qkv)
        self.add_lora(i, "qkv", x, qkv)
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        k, v = k.view(t, c.num_kv_heads, d), v.reshape(t, c.num_kv_heads, d)
        self.attention.write_kv_cache(k, v, kv[0], kv[1], attn_meta.slot_mapping)
        out = self.attention.paged_attention(q.reshape(t, c.num_heads, d), kv[0], kv[1], attn_meta.block_tables,
                                             attn_meta.cu_seqlens_q, attn_meta.seq_lens, d ** -0.5,
                                             plan=attn_meta.plan)
        return self.row_parallel(out.reshape(t, c.num_heads * d), o, residual, (i, "o"))
