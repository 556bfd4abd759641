"""The attention call of a layer: write the step's k and v into the paged KV cache, then attend over it.

The backend (kernels: the torch reference with its CPU decode kernel, or Triton) is picked at load by the runner;
this op holds it with the model's scale and each layer's extras (a sliding window, soft-capping)."""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.model.config import ModelConfig


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from the config's layer_types."""
    types = config.layer_types or ["full_attention"] * config.num_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


class PagedAttention:
    """o [T, Hq * D] of q/k heads qk [T, Hq + Hkv, D] and v [T, Hkv, D] for layer i."""

    def __init__(self, config: ModelConfig, backend: Any):
        self.backend = backend  # anything with write_kv_cache / paged_attention
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.q_size = config.num_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # Per layer: the backend's keyword arguments beyond the defaults (a sliding window, soft-capping).
        self.layer_kwargs: list[dict] = [
            {k: v for k, v in (("sliding_window", wnd), ("softcap", config.attn_logit_softcapping)) if v}
            for wnd in layer_windows(config)]

    def __call__(self, i: int, qk: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                 ) -> torch.Tensor:
        # q and k are strided views of one tensor (roped together), which the backends accept
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache[i, 0], kv_cache[i, 1]
        self.backend.write_kv_cache(k, v, key_cache, value_cache, attn_meta.slot_mapping)
        o = self.backend.paged_attention(q, key_cache, value_cache, attn_meta.block_tables, attn_meta.cu_seqlens_q,
                                         attn_meta.seq_lens, self.scale, plan=attn_meta.plan, **self.layer_kwargs[i])
        return o.reshape(qk.shape[0], self.q_size)
