"""What the hybrid families share: decoders whose layers are either attention over the paged KV or a recurrent
mixer with a fixed-size state per sequence (worker_svc/state_cache.py).

The forward takes one more input than LlamaModel's: `state` (state_cache.StateStep), the pool and each sequence's
slot. Attention layer i uses KV layer `kv_index[i]` (only attention layers have KV); recurrent layer i uses state
layer `state_index[i]`. A family says how its layers read (`_build_layers`), what its state is (`state_shape`) and
runs its layers (`_layers`) over the model's `HybridOps` (built once for the device's mode, `use_ops`); the embedding,
the final norm and the head are LlamaModel's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import kernels
from worker_svc.core.kv_cache import ATTENTION_LAYER_TYPES
from worker_svc.core.state_cache import StateShape, StateStep
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import Collectives, LlamaModel
from worker_svc.model.layers.activation import SiluAndMul
from worker_svc.model.layers.causal_conv import CausalConv1d
from worker_svc.model.layers.gated_delta_rule import GatedDeltaRule
from worker_svc.model.layers.linear import Linear, LinearAdd, pack_linear_weight, prepack_supported
from worker_svc.model.layers.norm import Float32RMSNorm
from worker_svc.model.layers.op import op_mode
from worker_svc.model.layers.rotary import PartialRotary
from worker_svc.model.layers.ssd_scan import SSDScan

RECURRENT_LAYER_TYPES = ("linear_attention", "mamba")  # Gated DeltaNet; Mamba2: the layers with a state slot


@dataclass
class HybridOps:
    """The layer ops a hybrid family's layers call, each built for the model's mode (`rms_norm`, `linear` and
    `silu_mul` are named as in DecoderOps: LlamaModel's final norm and head call them)."""

    rms_norm: Float32RMSNorm
    linear: Linear
    linear_add: LinearAdd
    silu_mul: SiluAndMul
    rope: PartialRotary | None  # None: the family's attention has no rope
    conv: CausalConv1d
    delta_rule: GatedDeltaRule
    ssd_scan: SSDScan


class HybridModel(LlamaModel):
    hybrid: ClassVar[bool] = True  # the runner sizes a state pool and passes `state`
    gguf: ClassVar[bool] = False
    embed_name: ClassVar[str] = "model.embed_tokens.weight"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attention: Any = None, max_position: int | None = None,
                 prepack: bool | None = None, tp: Collectives | None = None):
        # With `tp`: one rank of a group, `config` its local heads (sharding.local_config), `weights` its shard.
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.first_rank = self.tp is None or self.tp.rank == 0
        self.dtype = dtype
        self.device = torch.device(device)
        self.prepacked = prepack_supported(self.device, dtype) if prepack is None else prepack
        self.lora: Any = None
        self.attention = attention if attention is not None else kernels
        self.max_position = max_position or config.max_position_embeddings
        self.cpu_ops = None
        self.cpu_layers = None  # the C++ layer loop runs Llama-shaped layers only
        types = config.layer_types or []
        self.kv_index = {i: j for j, i in enumerate(i for i, t in enumerate(types) if t in ATTENTION_LAYER_TYPES)}
        recurrent = [i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES]
        self.state_index = {i: j for j, i in enumerate(recurrent)}
        self.attn_kwargs = [{} for _ in range(config.num_layers)]
        self.cos_cache = self.sin_signed_cache = None  # a family with rope sets its tables in _build_layers

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def mat(t: torch.Tensor) -> torch.Tensor:
            return pack_linear_weight(t.contiguous()) if self.prepacked else t

        self.embed = w(self.embed_name)
        self.vocab_start = self.tp.rank * self.embed.shape[0] if self.tp else 0  # a vocabulary-parallel shard
        self._build_layers(weights, w, mat)
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = mat(self.embed if tied else w("lm_head.weight"))
        self.use_ops(op_mode(self.device))

    def use_ops(self, mode: str) -> None:
        rope = None if self.cos_cache is None else PartialRotary(self.cos_cache, self.sin_signed_cache, mode)
        self.rotaries = [] if rope is None else [rope]
        self.ops = HybridOps(Float32RMSNorm(self.config.rms_norm_eps, mode), Linear(mode), LinearAdd(mode),
                             SiluAndMul(mode), rope, CausalConv1d(mode), GatedDeltaRule(mode), SSDScan(mode))

    def _build_layers(self, weights: dict, w, mat) -> None:
        raise NotImplementedError

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                     lora: tuple[int, str] | None = None) -> torch.Tensor:
        """residual + x @ weight.T, the product summed over the ranks (each holds some of weight's input columns);
        `lora`: (layer, group) whose adapter delta joins the product before the sum."""
        out = self.ops.linear_add(x, weight, None, residual) if self.tp is None else self.ops.linear(x, weight)
        if lora is not None:
            self.add_lora(*lora, x, out)
        return out if self.tp is None else residual.add_(self.reduce(out))

    def state_shape(self) -> StateShape:
        raise NotImplementedError

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (len(self.kv_index), 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None,
                state: StateStep | None = None):
        if state is None:
            raise ValueError(f"{self.config.architecture} is a hybrid model: its forward needs the state pool")
        h = self._layers(self.embed_tokens(input_ids), positions, kv_cache, attn_meta, state)
        if self.capture is not None:  # an EAGLE-3 head may read the last layer's output
            self.capture.layer_input(self.config.num_layers, h)
        return self.head(h, logits_indices, pool_indices)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                state: StateStep) -> torch.Tensor:
        raise NotImplementedError

    __call__ = forward

