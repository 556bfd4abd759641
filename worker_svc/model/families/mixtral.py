"""Mixtral: Mistral's attention (sliding window when set) with a sparse MoE block in every layer; the kept top-k
routing weights are always renormalised, and stay float32 until they scale the expert outputs."""

from __future__ import annotations

from worker_svc.model.families.llama import Mistral
from worker_svc.model.families.sparse_moe import SparseMoE, moe_fields


class Mixtral(SparseMoE, Mistral):
    """MixtralForCausalLM: `block_sparse_moe.gate` routes, `block_sparse_moe.experts.N.w1/w3/w2` are each expert's
    gate/up/down projections, `intermediate_size` is each expert's."""

    name = "mixtral"
    gguf = False  # llama.cpp stores Mixtral as llama with stacked expert tensors: not read yet
    moe_block = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    route_float32 = True

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        return {**super().hf_config(cfg), **moe_fields(cfg, cfg.get("num_local_experts"), cfg["intermediate_size"],
                                                       norm_topk_prob=True)}
