"""Llama, Mistral and Qwen2: the Llama-shaped decoder (worker_svc.model.LlamaModel); they differ in how their
config.json reads (Mistral's and Qwen2's sliding windows) and in their GGUF conventions."""

from __future__ import annotations

from typing import ClassVar

from worker_svc.model.decoder import LlamaModel
from worker_svc.model.families.hf import require, windowed_layer_types

# Per-layer GGUF tensor name -> HF name (the layer prefixes are added around them).
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Llama(LlamaModel):
    """LlamaForCausalLM. The class attributes and `hf_config` are what the loader reads per family."""

    name: ClassVar[str] = "llama"  # ModelConfig.architecture; GGUF's general.architecture
    gguf: ClassVar[bool] = True  # the GGUF loader reads this family
    gguf_layer_names: ClassVar[dict[str, str]] = GGUF_LAYER_NAMES
    gguf_permuted_qk: ClassVar[bool] = True  # llama.cpp's converter reorders q/k rows for GGML's rope

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        """The family's ModelConfig fields from config.json (beyond the common ones the loader reads);
        ValueError naming the field for an option this model would ignore."""
        require(cfg, "hidden_act", ("silu",), "silu")
        require(cfg, "mlp_bias", (False, None))
        return {}

    @classmethod
    def gguf_config(cls, key) -> dict:
        """The family's ModelConfig fields from GGUF metadata (`key(name, default)` reads `{arch}.{name}`)."""
        return {}


class Mistral(Llama):
    """MistralForCausalLM: every layer slides when `sliding_window` is set."""

    name = "mistral"

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        base = super().hf_config(cfg)
        window = cfg.get("sliding_window")
        types = ["sliding_attention"] * cfg["num_hidden_layers"] if window else None
        return {**base, "sliding_window": window or None, "layer_types": types}

    @classmethod
    def gguf_config(cls, key) -> dict:
        window = key("attention.sliding_window")
        n = int(key("block_count"))
        return {"sliding_window": int(window), "layer_types": ["sliding_attention"] * n} if window else {}


class Qwen2(Llama):
    """Qwen2ForCausalLM: layers from `max_window_layers` on slide when `use_sliding_window` is set."""

    name = "qwen2"
    gguf_permuted_qk = False  # stored in HF (neox) order

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        base = super().hf_config(cfg)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = windowed_layer_types(cfg, window, cfg.get("max_window_layers", 28))
        return {**base, "sliding_window": window if types and "sliding_attention" in types else None,
                "layer_types": types}
