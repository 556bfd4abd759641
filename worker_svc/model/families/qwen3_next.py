"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers (`linear_attention`, layers/gated_deltanet.py) with a
few gated full-attention layers; Qwen3-Next's feed-forward is a sparse MoE with a gated shared expert.

As transformers computes them: every RMSNorm is zero-centred (x * (1 + w), in float32 then rounded); the attention
layer's q-projection yields a query and a sigmoid gate per head, q and k are RMS-normed per head, rope turns only the
first `partial_rotary_factor` of each head; Qwen3.5's multimodal rope (mrope) reduces to that for text, where its
three position grids are equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.core.state_cache import StateShape, StateStep
from worker_svc.model.families.hf import require
from worker_svc.model.families.hybrid import HybridModel
from worker_svc.model.families.sparse_moe import moe_fields
from worker_svc.model.layers import moe
from worker_svc.model.layers.gated_deltanet import DeltaNetDims, DeltaNetWeights, deltanet_mixer
from worker_svc.model.layers.rotary import rope_tables

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [H * 2D + 2 * Hkv * D, hidden]: per head query then gate rows, then k, then v
    o: torch.Tensor
    q_norm: torch.Tensor  # [D] float32 (1 + w)
    k_norm: torch.Tensor


@dataclass
class FeedForwardWeights:
    gate: torch.Tensor | None = None  # the dense MLP, or the shared expert of a sparse layer
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    moe: moe.MoEWeights | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]: sigmoid gate of the shared expert


@dataclass
class Layer:
    input_norm: torch.Tensor  # float32 (1 + w)
    post_norm: torch.Tensor
    mixer: AttentionWeights | DeltaNetWeights
    ffn: FeedForwardWeights


def _hybrid_fields(cfg: dict) -> dict[str, Any]:
    """The fields both families read the same way; ValueError naming the config.json field."""
    require(cfg, "hidden_act", ("silu",), "silu")
    require(cfg, "attention_bias", (False, None))
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer attends
        every = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - set(LAYER_TYPES):
        raise ValueError(f"config.json field layer_types must list {' or '.join(LAYER_TYPES)} for each of the {n} "
                         f"layers (num_hidden_layers); got {types!r}")
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rot = int(head_dim * factor)
    if rot < 2 or rot % 2:
        raise ValueError(f"config.json field partial_rotary_factor={factor!r} turns {rot} of the {head_dim} head "
                         "dims: it must be an even number >= 2")
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if vh % kh:
        raise ValueError(f"config.json field linear_num_value_heads={vh} must be a multiple of "
                         f"linear_num_key_heads={kh}")
    return {"layer_types": list(types), "linear_num_key_heads": kh, "linear_num_value_heads": vh,
            "linear_key_head_dim": cfg["linear_key_head_dim"], "linear_value_head_dim": cfg["linear_value_head_dim"],
            "linear_conv_kernel_dim": cfg.get("linear_conv_kernel_dim", 4), "partial_rotary_factor": float(factor)}


class Qwen3Next(HybridModel):
    """Qwen3NextForCausalLM: in-projections `in_proj_qkvz` / `in_proj_ba` grouped per key head; MoE in the layers
    that `mlp_only_layers` and `decoder_sparse_step` leave sparse."""

    name = "qwen3_next"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        base = _hybrid_fields(cfg)
        n = cfg["num_hidden_layers"]
        num_experts = cfg.get("num_experts", 0)
        if not num_experts:
            return {**base, "moe_layers": []}
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"config.json field decoder_sparse_step must be an int >= 1, got {step!r}")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        return {**base, **moe_fields(cfg, num_experts, cfg["moe_intermediate_size"], cfg.get("norm_topk_prob", True),
                                     sparse),
                "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size", 0)}

    def state_shape(self) -> StateShape:
        return self.dims.state_shape(len(self.state_index))

    def _build_layers(self, weights: dict, w, mat) -> None:
        c = self.config
        self.dims = DeltaNetDims(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                 c.linear_value_head_dim, c.linear_conv_kernel_dim)

        def norm(name: str) -> torch.Tensor:
            return 1.0 + weights[name].to(self.device, torch.float32)

        self.layers: list[Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            if i in self.kv_index:
                a = p + "self_attn."
                mixer = AttentionWeights(mat(torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"])),
                                         mat(w(a + "o_proj.weight")), norm(a + "q_norm.weight"),
                                         norm(a + "k_norm.weight"))
            else:
                la = p + "linear_attn."
                mixer = DeltaNetWeights(mat(self._in_proj(la, w)), w(la + "conv1d.weight").squeeze(1),
                                        w(la + "dt_bias"), -weights[la + "A_log"].to(self.device, torch.float32).exp(),
                                        w(la + "norm.weight"), mat(w(la + "out_proj.weight")))
            self.layers.append(Layer(norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight"),
                                     mixer, self._feed_forward_layer(i, w, mat)))
        self.norm = norm("model.norm.weight")
        rot = int(c.head_dim * c.partial_rotary_factor)  # the ops' PartialRotary turns these first dims of a head
        self.cos_cache, self.sin_signed_cache = rope_tables(dataclasses.replace(c, head_dim=rot), self.max_position,
                                                            self.dtype, self.device)
        self.experts_fn = moe.select_experts_fn(self.device)

    def _in_proj(self, prefix: str, w) -> torch.Tensor:
        """The fused [q | k | v | z | b | a] rows from the checkpoint's per-key-head groups."""
        d = self.dims
        r = d.value_heads // d.key_heads
        qkvz = w(prefix + "in_proj_qkvz.weight").view(d.key_heads, -1, self.config.hidden_size)
        q, k, v, z = qkvz.split([d.key_dim, d.key_dim, r * d.value_dim, r * d.value_dim], dim=1)
        ba = w(prefix + "in_proj_ba.weight").view(d.key_heads, 2 * r, -1)
        b, a = ba.split([r, r], dim=1)
        return torch.cat([x.reshape(-1, x.shape[-1]) for x in (q, k, v, z, b, a)])

    def _feed_forward_layer(self, i: int, w, mat) -> FeedForwardWeights:
        c = self.config
        p = f"model.layers.{i}.mlp."
        if c.moe_layers is None or i not in c.moe_layers:
            return FeedForwardWeights(*(mat(w(p + f"{x}_proj.weight")) for x in ("gate", "up", "down")))
        gate, up, down = ([w(f"{p}experts.{e}.{x}_proj.weight") for e in range(c.num_experts)]
                          for x in ("gate", "up", "down"))
        gate_up, down = moe.stack_experts(gate, up, down)
        if self.prepacked:
            gate_up, down = [mat(t) for t in gate_up], [mat(t) for t in down]
        block = moe.MoEWeights(w(p + "gate.weight"), gate_up, down, c.num_experts_per_tok, c.norm_topk_prob,
                               float32_weights=False)  # transformers rounds the routing weights first
        shared = [None, None, None]
        shared_gate = None
        if c.shared_expert_intermediate_size:
            shared = [mat(w(p + f"shared_expert.{x}_proj.weight")) for x in ("gate", "up", "down")]
            shared_gate = w(p + "shared_expert_gate.weight")
        return FeedForwardWeights(*shared, moe=block, shared_gate=shared_gate)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                state: StateStep) -> torch.Tensor:
        ops = self.ops
        rope = ops.rope.prepare(positions)
        for i, layer in enumerate(self.layers):
            if self.capture is not None:  # an EAGLE-3 head reads some layers' inputs
                self.capture.layer_input(i, h)
            x = ops.rms_norm(h, layer.input_norm)
            if isinstance(layer.mixer, AttentionWeights):
                h = self._attention(i, x, layer.mixer, rope, kv_cache[self.kv_index[i]], attn_meta, h)
            else:
                j = self.state_index[i]
                out = deltanet_mixer(x, layer.mixer, self.dims, state.cache.conv[j], state.cache.ssm[j], state.slots,
                                     state.cu_seqlens, self.config.rms_norm_eps, ops.linear, ops.conv, ops.delta_rule,
                                     state.split)
                h = h.add_(self.reduce(out))  # the out-projection's partial products, summed over the ranks
            h = self._mlp(i, ops.rms_norm(h, layer.post_norm), layer.ffn, h)
        return h

    def _attention(self, i: int, x: torch.Tensor, w: AttentionWeights, rope: Any, kv: torch.Tensor, attn_meta: Any,
                   residual: torch.Tensor) -> torch.Tensor:
        c, ops = self.config, self.ops
        t, d, heads = x.shape[0], c.head_dim, c.num_heads
        qkv = ops.linear(x, w.qkv)
        self.add_lora(i, "qkv", x, qkv)  # q_proj's adapter rows hold the query and the gate, as its weight's do
        qg, k, v = qkv.split([heads * 2 * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        q, gate = qg.view(t, heads, 2 * d).chunk(2, dim=-1)
        q = ops.rope(ops.rms_norm(q, w.q_norm), rope)
        k = ops.rope(ops.rms_norm(k.view(t, c.num_kv_heads, d), w.k_norm), rope)
        v = v.reshape(t, c.num_kv_heads, d)
        self.attention.write_kv_cache(k, v, kv[0], kv[1], attn_meta.slot_mapping)
        o = self.attention.paged_attention(q.contiguous(), kv[0], kv[1], attn_meta.block_tables,
                                           attn_meta.cu_seqlens_q, attn_meta.seq_lens, d ** -0.5,
                                           plan=attn_meta.plan)
        o = o.reshape(t, heads * d) * torch.sigmoid(gate.reshape(t, heads * d))
        return self.row_parallel(o, w.o, residual, (i, "o"))

    def _mlp(self, i: int, x: torch.Tensor, w: FeedForwardWeights, residual: torch.Tensor) -> torch.Tensor:
        out = None if w.moe is None else moe.moe_forward(x, w.moe, self.experts_fn)
        if w.gate is not None:
            ops = self.ops
            gate, up = ops.linear(x, w.gate), ops.linear(x, w.up)
            self.add_lora(i, "gate", x, gate)  # a no-op in a sparse layer: adapters take its dense MLP only
            self.add_lora(i, "up", x, up)
            act = ops.silu_mul(gate, up)
            dense = ops.linear(act, w.down)
            self.add_lora(i, "down", act, dense)
            if w.shared_gate is not None:
                dense = torch.sigmoid(ops.linear(x, w.shared_gate)) * dense
            out = dense if out is None else out + dense
        return residual.add_(self.reduce(out))


class Qwen3_5(Qwen3Next):
    """Qwen3_5ForCausalLM (the text model): separate in-projections `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    `in_proj_a`; a dense MLP in every layer."""

    name = "qwen3_5"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        return {**_hybrid_fields(cfg), "moe_layers": []}

    def _in_proj(self, prefix: str, w) -> torch.Tensor:
        return torch.cat([w(prefix + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])
