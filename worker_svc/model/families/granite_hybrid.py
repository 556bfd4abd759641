"""Granite 4.0 hybrid (GraniteMoeHybridForCausalLM): Mamba2 layers (layers/mamba2_mixer.py) and attention layers
by `layer_types`, each followed by a feed-forward that is a shared SwiGLU MLP, plus a sparse MoE where
`num_local_experts` > 0. Granite's multipliers as transformers applies them: the embeddings times
`embedding_multiplier`, every residual branch times `residual_multiplier`, attention scaled by `attention_multiplier`,
the logits divided by `logits_scaling`; attention turns rope only with `position_embedding_type` "rope".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.core.state_cache import StateShape, StateStep
from worker_svc.model.families.hf import require
from worker_svc.model.families.hybrid import HybridModel
from worker_svc.model.families.nemotron_h import mamba2_dims, mamba2_fields, mamba2_weights
from worker_svc.model.families.sparse_moe import moe_fields
from worker_svc.model.layers import moe
from worker_svc.model.layers.mamba2_mixer import Mamba2Weights, mamba2_mixer
from worker_svc.model.layers.rotary import rope_tables

HF_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention",
            "attention": "full_attention"}


@dataclass
class GraniteLayer:
    input_norm: torch.Tensor  # float32
    post_norm: torch.Tensor
    mixer: Any  # Mamba2Weights, or (qkv, o)
    shared_in: torch.Tensor  # [2 * shared, hidden]: gate then up
    shared_out: torch.Tensor
    moe: moe.MoEWeights | None


class GraniteMoeHybrid(HybridModel):
    name = "granitemoehybrid"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        given = cfg.get("layer_types") or cfg.get("layers_block_type")
        n = cfg["num_hidden_layers"]
        if not given or len(given) != n or set(given) - set(HF_TYPES):
            raise ValueError(f"config.json field layer_types must list mamba or attention for each of the {n} "
                             f"layers (num_hidden_layers); got {given!r}")
        require(cfg, "hidden_act", ("silu",), "silu")
        require(cfg, "attention_bias", (False, None))
        require(cfg, "mamba_proj_bias", (False, None))
        require(cfg, "position_embedding_type", (None, "rope", "nope"))
        inner = int(cfg.get("mamba_expand", 2) * cfg["hidden_size"])
        if inner != cfg["mamba_n_heads"] * cfg["mamba_d_head"]:
            raise ValueError(f"config.json fields mamba_n_heads={cfg['mamba_n_heads']} x mamba_d_head="
                             f"{cfg['mamba_d_head']} must equal mamba_expand x hidden_size = {inner}")
        limit = cfg.get("time_step_limit") or [0.0]
        fields = mamba2_fields({**cfg, "mamba_hidden_act": cfg.get("hidden_act", "silu"),
                                "time_step_min": float(limit[0])}, "mamba_n_groups", "mamba_n_heads",
                               "mamba_d_head", "mamba_d_conv", "mamba_d_state", "mamba_conv_bias")
        experts = cfg.get("num_local_experts", 0)
        moe_cfg = moe_fields(cfg, experts, cfg["intermediate_size"], True) if experts else {"moe_layers": []}
        names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        return {"layer_types": [HF_TYPES[t] for t in given], **fields, **moe_cfg,
                "shared_expert_intermediate_size": cfg["shared_intermediate_size"],
                "multipliers": {k: float(cfg.get(k, 1.0)) for k in names},
                "use_rope": cfg.get("position_embedding_type") == "rope"}

    def state_shape(self) -> StateShape:
        return self.dims.state_shape(len(self.state_index))

    def _build_layers(self, weights: dict, w, mat) -> None:
        c = self.config
        self.dims = mamba2_dims(c)
        scale = c.multipliers or {}
        self.embedding_multiplier = scale.get("embedding_multiplier", 1.0)
        self.residual_multiplier = scale.get("residual_multiplier", 1.0)
        self.attention_multiplier = scale.get("attention_multiplier", c.head_dim ** -0.5)
        self.logits_scaling = scale.get("logits_scaling", 1.0)

        def f32(name: str) -> torch.Tensor:
            return weights[name].to(self.device, torch.float32)

        self.layers: list[GraniteLayer] = []
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            if kind == "mamba":
                mixer: Mamba2Weights | tuple = mamba2_weights(p + "mamba.", weights, w, mat, self.device)
            else:
                a = p + "self_attn."
                mixer = (mat(torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"])), mat(w(a + "o_proj.weight")))
            block = None
            if c.num_experts:
                e = p + "block_sparse_moe."
                gate_up, down = w(e + "input_linear.weight"), w(e + "output_linear.weight")
                if self.prepacked:
                    gate_up, down = [mat(t) for t in gate_up], [mat(t) for t in down]
                block = moe.MoEWeights(w(e + "router.layer.weight"), gate_up, down, c.num_experts_per_tok, True,
                                       float32_weights=False)  # transformers rounds the routing weights first
            shared = p + "shared_mlp."
            self.layers.append(GraniteLayer(f32(p + "input_layernorm.weight"),
                                            f32(p + "post_attention_layernorm.weight"), mixer,
                                            mat(w(shared + "input_linear.weight")),
                                            mat(w(shared + "output_linear.weight")), block))
        self.norm = f32("model.norm.weight")
        if c.use_rope:  # the ops' rotary (none without the tables)
            self.cos_cache, self.sin_signed_cache = rope_tables(c, self.max_position, self.dtype, self.device)
        self.experts_fn = moe.select_experts_fn(self.device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embedding_multiplier

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None):
        out = super().head(h, logits_indices, pool_indices)
        if out is None:  # a tensor-parallel rank other than 0: the logits are gathered on rank 0
            return None
        if pool_indices is None:
            return out / self.logits_scaling
        return out[0] / self.logits_scaling, out[1]

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                state: StateStep) -> torch.Tensor:
        c, ops, m = self.config, self.ops, self.residual_multiplier
        rope = None if ops.rope is None else ops.rope.prepare(positions)
        for i, layer in enumerate(self.layers):
            if self.capture is not None:  # an EAGLE-3 head reads some layers' inputs
                self.capture.layer_input(i, h)
            x = ops.rms_norm(h, layer.input_norm)
            if isinstance(layer.mixer, Mamba2Weights):
                j = self.state_index[i]
                out = mamba2_mixer(x, layer.mixer, self.dims, state.cache.conv[j], state.cache.ssm[j], state.slots,
                                   state.cu_seqlens, c.rms_norm_eps, ops.linear, ops.conv, ops.ssd_scan,
                                   state.split)
            else:
                out = self._attention(i, x, *layer.mixer, rope, kv_cache[self.kv_index[i]], attn_meta)
            h = h + self.reduce(out) * m  # each rank's heads' part of the out-projection, summed
            x = ops.rms_norm(h, layer.post_norm)
            gate_up = ops.linear(x, layer.shared_in)
            self.add_lora(i, "shared_in", x, gate_up)
            act = ops.silu_mul(*gate_up.chunk(2, dim=-1))
            out = ops.linear(act, layer.shared_out)
            self.add_lora(i, "shared_out", act, out)
            if layer.moe is not None:
                out = moe.moe_forward(x, layer.moe, self.experts_fn) + out
            h = h + self.reduce(out) * m
        return h

    def _attention(self, i, x, qkv, o, rope, kv, attn_meta) -> torch.Tensor:
        c, ops = self.config, self.ops
        t, d = x.shape[0], c.head_dim
        qkv = ops.linear(x, qkv)
        self.add_lora(i, "qkv", x, qkv)
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        q, k, v = q.view(t, c.num_heads, d), k.view(t, c.num_kv_heads, d), v.reshape(t, c.num_kv_heads, d)
        if rope is not None:  # `rope` is the step's prepared rotary
            q, k = ops.rope(q, rope), ops.rope(k, rope)
        self.attention.write_kv_cache(k, v, kv[0], kv[1], attn_meta.slot_mapping)
        out = self.attention.paged_attention(q.contiguous(), kv[0], kv[1], attn_meta.block_tables,
                                             attn_meta.cu_seqlens_q, attn_meta.seq_lens, self.attention_multiplier,
                                             plan=attn_meta.plan)
        out = out.reshape(t, c.num_heads * d)
        o_out = ops.linear(out, o)
        self.add_lora(i, "o", out, o_out)
        return o_out
