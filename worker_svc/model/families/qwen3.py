"""Qwen3 dense: Qwen2 plus a per-head RMSNorm of q and k before rope and an explicit head_dim; the shared
decoder runs it (LayerWeights.qk_norm)."""

from __future__ import annotations

from worker_svc.model.families.llama import GGUF_LAYER_NAMES, Qwen2


class Qwen3(Qwen2):
    """Qwen3ForCausalLM."""

    name = "qwen3"
    gguf_layer_names = {**GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
