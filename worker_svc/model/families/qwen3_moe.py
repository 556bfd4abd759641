"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE block in the layers that
`mlp_only_layers` and `decoder_sparse_step` leave sparse (the others run a dense MLP of `intermediate_size`)."""

from __future__ import annotations

from worker_svc.model.families.llama import Mistral
from worker_svc.model.families.qwen3 import Qwen3
from worker_svc.model.families.sparse_moe import SparseMoE, moe_fields


class Qwen3Moe(SparseMoE, Qwen3):
    """Qwen3MoeForCausalLM: `mlp.gate` routes, `mlp.experts.N.gate_proj/up_proj/down_proj` are the experts (of
    `moe_intermediate_size`); the kept routing weights are renormalised only with `norm_topk_prob`."""

    name = "qwen3_moe"
    gguf = False
    moe_block = "mlp."
    expert_names = ("gate_proj", "up_proj", "down_proj")
    route_float32 = False  # transformers rounds them to the activation dtype first

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        # Unlike Qwen2/Qwen3 dense, every layer slides when use_sliding_window is set (no max_window_layers).
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        base = Mistral.hf_config({**cfg, "sliding_window": window})
        n = cfg["num_hidden_layers"]
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"config.json field decoder_sparse_step must be an int >= 1, got {step!r}")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        return {**base, **moe_fields(cfg, num_experts, cfg["moe_intermediate_size"], cfg.get("norm_topk_prob", False),
                                     None if len(sparse) == n else sparse)}
