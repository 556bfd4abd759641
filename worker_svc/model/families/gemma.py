"""Gemma 2 and Gemma 3 (text): the Llama-shaped weights with Gemma's layer order and numerics.

Differences from Llama: RMSNorm scales by (1 + w) and rounds once at the end; the embedding is multiplied by
sqrt(hidden); four norms per layer (after attention and after the MLP as well, before each residual add);
GeGLU with tanh-GELU; attention scale query_pre_attn_scalar^-1/2; sliding and global layers interleaved
(`layer_types`); Gemma 2 soft-caps attention scores and the final logits; Gemma 3 RMS-normalizes q and k per
head and runs its sliding layers' rope at a different base (`rope_local_theta`, unscaled).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LayerWeights, LlamaModel
from worker_svc.model.families.hf import require, rope, windowed_layer_types
from worker_svc.model.layers.activation import GeluTanhAndMul
from worker_svc.model.layers.norm import gemma_rms_norm
from worker_svc.model.layers.op import NATIVE
from worker_svc.model.layers.rotary import Rotary, rope_tables


def _refuse_bidirectional(cfg: dict) -> None:
    require(cfg, "use_bidirectional_attention", (False, None))


class Gemma2(LlamaModel):
    """Gemma2ForCausalLM."""

    name: ClassVar[str] = "gemma2"
    gguf: ClassVar[bool] = False

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        require(cfg, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
        _refuse_bidirectional(cfg)
        window = cfg.get("sliding_window", 4096)
        # transformers' default: even layers slide, odd ones are global
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        return {"sliding_window": window, "layer_types": windowed_layer_types({**cfg, "layer_types": types}, window),
                "attn_logit_softcapping": cfg.get("attn_logit_softcapping", 50.0),
                "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0),
                "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256)}

    def __init__(self, config: ModelConfig, weights: dict, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_position: int | None = None, **kwargs):
        # Sliding layers' rope tables (Gemma 3: their own base, unscaled); global layers use the config's rope.
        self.local_rope = None if config.rope_local_theta is None else rope_tables(
            config, max_position or config.max_position_embeddings, dtype, torch.device(device),
            config.rope_local_theta, scaled=False)
        super().__init__(config, weights, dtype, device, max_position=max_position, **kwargs)

        def scale(name: str) -> torch.Tensor:  # 1 + w in float32, from w rounded to the model's dtype (as HF)
            return 1.0 + weights[name].to(device=self.device, dtype=dtype).float()

        # Norms around the MLP (the base class holds input_norm and post_norm, the one after attention).
        self.mlp_norms = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm = scale(p + "input_layernorm.weight")
            layer.post_norm = scale(p + "post_attention_layernorm.weight")
            if layer.qk_norm is not None:
                layer.qk_norm = 1.0 + layer.qk_norm.float()
            self.mlp_norms.append((scale(p + "pre_feedforward_layernorm.weight"),
                                   scale(p + "post_feedforward_layernorm.weight")))
        self.norm = scale("model.norm.weight")
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=self.device)
        if self.local_rope is not None:
            self.rope_of_layer = [int(t == "sliding_attention") for t in config.layer_types or []]

    def use_ops(self, mode: str) -> None:
        super().use_ops(mode)
        # Gemma's layers rope with torch's ops in every mode (they always have), from one or two tables.
        self.rotaries = [Rotary(self.cos_cache, self.sin_signed_cache, NATIVE)]
        if self.local_rope is not None:
            self.rotaries.append(Rotary(*self.local_rope, NATIVE))
        self.ops.rope = self.rotaries[0]
        self.gelu_mul = GeluTanhAndMul(mode)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(h, self.norm, self.config.rms_norm_eps)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def layer_forward(self, i: int, layer: LayerWeights, h: torch.Tensor, kv_cache: torch.Tensor, attn_meta,
                      rope) -> torch.Tensor:
        """Gemma's layer: each sublayer's output is normed before its residual add."""
        c, eps = self.config, self.config.rms_norm_eps
        n = h.shape[0]
        x = gemma_rms_norm(h, layer.input_norm, eps)
        qkv = self.ops.linear(x, layer.qkv, layer.qkv_bias)
        self.add_lora(i, "qkv", x, qkv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        if layer.qk_norm is not None:
            qk = gemma_rms_norm(qk, layer.qk_norm, eps)
        o = self.paged_attention(i, self.ops.rope(qk, rope), v.view(n, c.num_kv_heads, c.head_dim), kv_cache,
                                 attn_meta)
        h = h + gemma_rms_norm(self._row_parallel(i, "o", o, layer.o, layer.o_bias), layer.post_norm, eps)
        pre, post = self.mlp_norms[i]
        x = gemma_rms_norm(h, pre, eps)
        gate, up = self.ops.linear(x, layer.gate), self.ops.linear(x, layer.up)
        self.add_lora(i, "gate", x, gate)
        self.add_lora(i, "up", x, up)
        down = self._row_parallel(i, "down", self.gelu_mul(gate, up), layer.down, None)
        return h + gemma_rms_norm(down, post, eps)

    def _row_parallel(self, i: int, group: str, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias summed over tensor-parallel ranks (each holds some input columns; rank 0 the bias):
        Gemma normalizes this sum before the residual add, so it cannot be fused into the add. Each rank's partial
        LoRA delta of (layer i, group) joins the sum before the reduce."""
        out = self.ops.linear(x, weight, bias if self.first_rank else None)
        self.add_lora(i, group, x, out)
        return self.reduce(out)


class Gemma3(Gemma2):
    """Gemma3ForCausalLM (text only): q/k norms, no attention soft-capping by default, local rope base."""

    name = "gemma3"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        require(cfg, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
        _refuse_bidirectional(cfg)
        window = cfg.get("sliding_window", 4096)
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:  # 5.x: one rope per layer type
            theta, scaling = rope(params.get("full_attention"), "rope_parameters.full_attention", 1_000_000.0)
            local_theta, local_scaling = rope(params.get("sliding_attention"), "rope_parameters.sliding_attention")
            if local_scaling is not None:
                require({"rope_parameters.sliding_attention.rope_type": local_scaling["rope_type"]},
                        "rope_parameters.sliding_attention.rope_type", ("default",))
        else:  # 4.x keys
            theta, scaling = rope(cfg.get("rope_scaling"), "rope_scaling", cfg.get("rope_theta", 1_000_000.0))
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        return {"sliding_window": window, "layer_types": windowed_layer_types({**cfg, "layer_types": types}, window),
                "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
                "final_logit_softcapping": cfg.get("final_logit_softcapping"),
                "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
                "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}
