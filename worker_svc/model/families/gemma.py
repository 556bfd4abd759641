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
import torch.nn.functional as F

from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel, linear, rope_tables, swap_halves
from worker_svc.model.families.hf import require, rope, windowed_layer_types


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm; `scale` is 1 + w in float32 (any shape broadcasting over x's last dim, e.g. [H, D] for
    per-head norms). Normalized and scaled in float32, rounded to x's dtype once (Llama rounds before scaling)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, scale.shape[-1:], None, eps) * scale
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


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
                 device: torch.device | str = "cpu", **kwargs):
        super().__init__(config, weights, dtype, device, **kwargs)

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
        # Rope tables per layer: global layers use the config's rope, sliding ones (Gemma 3) their own base.
        self.ropes = [(self.cos_cache, self.sin_signed_cache)]
        self.rope_of_layer = [0] * config.num_layers
        if config.rope_local_theta is not None:
            self.ropes.append(rope_tables(config, self.max_position, dtype, self.device, config.rope_local_theta,
                                          scaled=False))
            types = config.layer_types or []
            self.rope_of_layer = [int(t == "sliding_attention") for t in types]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta,
                logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None):
        """LlamaModel.forward's contract: with `pool_indices`, (logits, the final normed hidden states there)."""
        c, eps = self.config, self.config.rms_norm_eps
        n = input_ids.shape[0]
        ropes = [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for cos, sin in self.ropes]
        h = self._embed(input_ids) * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = gemma_rms_norm(h, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            if self.lora is not None:
                self.lora.add(i, "qkv", x, qkv)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(n, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.qk_norm is not None:
                qk = gemma_rms_norm(qk, layer.qk_norm, eps)
            cos, sin = ropes[self.rope_of_layer[i]]
            q, k = (qk * cos + swap_halves(qk) * sin).split([c.num_heads, c.num_kv_heads], dim=1)
            key_cache, value_cache = kv_cache[i, 0], kv_cache[i, 1]
            self.attention.write_kv_cache(k, v.view(n, c.num_kv_heads, c.head_dim), key_cache, value_cache,
                                          attn_meta.slot_mapping)
            o = self.attention.paged_attention(q, key_cache, value_cache, attn_meta.block_tables,
                                               attn_meta.cu_seqlens_q, attn_meta.seq_lens, self.scale,
                                               plan=attn_meta.plan, **self.attn_kwargs[i])
            o_in = o.reshape(n, self.q_size)
            o = self._row_parallel(o_in, layer.o, layer.o_bias, (i, "o"))
            h = h + gemma_rms_norm(o, layer.post_norm, eps)
            pre, post = self.mlp_norms[i]
            x = gemma_rms_norm(h, pre, eps)
            gate, up = linear(x, layer.gate), linear(x, layer.up)
            if self.lora is not None:
                self.lora.add(i, "gate", x, gate)
                self.lora.add(i, "up", x, up)
            m = F.gelu(gate, approximate="tanh").mul_(up)
            down = self._row_parallel(m, layer.down, None, (i, "down"))
            h = h + gemma_rms_norm(down, post, eps)
        pooled = None if pool_indices is None else gemma_rms_norm(h[pool_indices], self.norm, eps)
        h = gemma_rms_norm(h[logits_indices], self.norm, eps)
        logits = linear(h, self.lm_head)
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        logits = logits.float()
        if self.tp is not None:
            logits = self.tp.gather_to_first(logits)
            logits = None if logits is None else logits[:, : c.vocab_size]
        return logits if pooled is None else (logits, pooled)

    def _row_parallel(self, x: torch.Tensor, weight, bias: torch.Tensor | None,
                      lora_at: tuple[int, str]) -> torch.Tensor:
        """x @ weight.T + bias summed over tensor-parallel ranks (each holds some input columns; rank 0 the bias):
        Gemma normalizes this sum before the residual add, so it cannot be fused into the add. Each rank's partial
        LoRA delta of (layer, group) `lora_at` joins the sum before the reduce."""
        out = linear(x, weight, bias if self.tp is None or self.tp.rank == 0 else None)
        if self.lora is not None:
            self.lora.add(*lora_at, x, out)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out

    __call__ = forward


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
