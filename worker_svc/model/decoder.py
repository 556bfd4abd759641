"""The Llama-shaped decoder over a paged KV cache: the skeleton every family shares, and Llama's layer.

`LlamaModel` runs Llama, Mistral, Qwen2 and Qwen3 (q/k norm); other families (worker_svc/model/families/) subclass
it and override the parts of the layer that differ. The layer is written once over the layer ops
(worker_svc/model/layers/), which picked their implementation at load: eager torch, the CPU's C++ kernels, or (the
compiled forward's twin, `traced`) plain torch for inductor to trace. The fused C++ layer loop
(worker_svc/cpu/layer_loop.py) is the runner's choice, for a model whose `runs_llama_layers`.

One forward runs one flattened batch: prefill chunks and decode tokens of many sequences are
concatenated into `num_tokens` rows. Everything except attention is per-token, so only
attention needs to know about sequences; it gets that from `attn_meta` (kernels.AttentionMetadata).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_ops
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers.activation import SiluAndMul
from worker_svc.model.layers.attention import PagedAttention
from worker_svc.model.layers.linear import Linear, LinearAdd, pack_linear_weight, prepack_supported
from worker_svc.model.layers.norm import RMSNorm, head_rms_norm
from worker_svc.model.layers.op import NATIVE, op_mode
from worker_svc.model.layers.rotary import Rotary, rope_tables
from worker_svc.model.quant import QuantizedWeight, QuantLinear, cat_rows, check_activation_dtype, fp8_kernel_takes


@dataclass
class LayerWeights:
    """Matmul weights are [out, in]: dense, packed for the CPU (`pack_linear_weight`) or quantized: use `linear`."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 * Hkv) * D, hidden]: q, k, v fused into one matmul
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    # [intermediate, hidden]; two matmuls measured faster on CPU than one fused gate+up. None in a sparse layer.
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None  # [Hq + Hkv, D]: per-head q then k RMSNorm weights (Qwen3); None: none
    moe: Any = None  # worker_svc.model.layers.moe.MoEWeights: a sparse block instead of gate/up/down (`_feed_forward`)


class Collectives(Protocol):
    """What a tensor-parallel rank's model needs from its process group (worker_svc.parallel.RankGroup)."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> None: ...  # in place, sum over ranks

    def gather_to_first(self, t: torch.Tensor) -> torch.Tensor | None: ...  # cat on the last dim, rank 0 only


class LlamaModel:
    """Inference-only decoder. Weights are plain tensors; there is no autograd anywhere.

    `capture` (worker_svc/model/hidden_capture.HiddenCapture): hidden states a speculative head reads; None: off.

    With `tp`, this is one rank of a tensor-parallel group: `config` is the rank's local config
    (tensor_parallel.local_config) and `weights` its shard (tensor_parallel.shard_weights); `forward` returns
    the logits on rank 0 and None on the others.
    """

    capture: Any = None

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention: Any = None,
        max_position: int | None = None,
        prepack: bool | None = None,
        tp: Collectives | None = None,
    ):
        """prepack: matmul weights packed for the CPU (`pack_linear_weight`; None: where `prepack_supported`, i.e.
        float32 on CPU, and bfloat16 on a CPU with native bf16)."""
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.first_rank = self.tp is None or self.tp.rank == 0  # adds the residual and biases into its products
        self.dtype = dtype
        self.device = torch.device(device)
        if prepack is None:
            prepack = prepack_supported(self.device, dtype)
        self.prepacked = prepack
        # Multi-LoRA (worker_svc/model/lora.LoraPool): each projection adds lora.add(layer, group, x, out); None: off.
        self.lora: Any = None
        # Anything with write_kv_cache / paged_attention (the torch reference or a Triton backend).
        self.attention = attention if attention is not None else kernels
        self.paged_attention = PagedAttention(config, self.attention)
        self.scale, self.attn_kwargs = self.paged_attention.scale, self.paged_attention.layer_kwargs
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

        if any(isinstance(t, QuantizedWeight) for t in weights.values()):
            check_activation_dtype(dtype, self.device)

        def w(name: str) -> torch.Tensor:
            t = weights[name]  # a QuantizedWeight is moved to the device when packed (`mat`)
            return t if isinstance(t, QuantizedWeight) else t.to(device=self.device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def mat(t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantLinear:
            """A matmul weight; the dense copy is dropped once packed. An FP8 weight on the CPU that the project's
            FP8 kernel does not take (the loader dequantizes those, hf_quant.runs_as_fp8; this covers weights built
            elsewhere) is dequantized here, once, into `dtype`: torch has no FP8 matmul on the CPU, and dequantizing
            the whole matrix on every call cost 10-15x the matmul (experiments/fp8_matmul_cost.py)."""
            if isinstance(t, QuantizedWeight) and t.is_fp8 and self.device.type == "cpu" \
                    and not (dtype in (torch.float32, torch.bfloat16) and fp8_kernel_takes(t)):
                t = t.dequantize(dtype)
            if isinstance(t, QuantizedWeight):
                return QuantLinear(t, dtype, self.device)
            return pack_linear_weight(t.contiguous()) if prepack else t

        def cat(parts: list) -> torch.Tensor | QuantizedWeight:
            return cat_rows(parts) if isinstance(parts[0], QuantizedWeight) else torch.cat(parts)

        self.embed = w("model.embed_tokens.weight")
        if isinstance(self.embed, QuantizedWeight):
            self.embed = self.embed.map_rows(lambda t: t.to(self.device))
        # Vocabulary-parallel: this rank's token rows start here (its shard is padded to the same rows on all ranks).
        self.vocab_start = self.tp.rank * self.embed.shape[0] if self.tp else 0
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_bias = qk_norm = None
            if attn + "q_proj.bias" in weights:
                qkv_bias = torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])
            if attn + "q_norm.weight" in weights:
                qk_norm = torch.cat([w(attn + "q_norm.weight").expand(config.num_heads, -1),
                                     w(attn + "k_norm.weight").expand(config.num_kv_heads, -1)])
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=mat(cat([w(attn + f"{x}_proj.weight") for x in "qkv"])),
                    qkv_bias=qkv_bias,
                    o=mat(w(attn + "o_proj.weight")),
                    o_bias=maybe(attn + "o_proj.bias"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    qk_norm=qk_norm,
                    **self._feed_forward_weights(i, weights, w, mat),
                )
            )
        self.norm = w("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        # tied + prepacked: the head is a packed copy of the embedding (which stays dense for the lookup)
        self.lm_head = mat(self.embed if tied else w("lm_head.weight"))

        # cos/sin for every position; sin with its first half negated, for rope as x * cos + swap_halves(x) * sin
        self.max_position = max_position or config.max_position_embeddings
        self.cos_cache, self.sin_signed_cache = rope_tables(config, self.max_position, dtype, self.device)
        # The C++ CPU kernels (the layer loop reads them from here), or None.
        self.cpu_ops = cpu_ops.load() if self.device.type == "cpu" else None
        self.rope_of_layer = [0] * config.num_layers  # which of `rotaries` (tables) each layer ropes with
        self.use_ops(op_mode(self.device))

    def use_ops(self, mode: str) -> None:
        """Build the layer ops for `mode` (layers/op.py); a family with ops of its own extends this."""
        self.rotaries = [Rotary(self.cos_cache, self.sin_signed_cache, mode)]
        self.ops = DecoderOps(RMSNorm(self.config.rms_norm_eps, mode), Linear(mode), LinearAdd(mode),
                              SiluAndMul(mode), self.rotaries[0])

    def traced(self) -> LlamaModel:
        """A twin of this model (the same weights) whose ops are plain torch, for torch.compile to trace."""
        twin = copy.copy(self)
        twin.use_ops(NATIVE)
        return twin

    def runs_llama_layers(self) -> bool:
        """Whether the family runs this class's layer unchanged: what the fused C++ layer loop and the compiled
        graphs implement."""
        return all(getattr(type(self), f) is getattr(LlamaModel, f)
                   for f in ("layer_forward", "attention_inputs", "post_attention", "attention_output", "mlp",
                             "feed_forward", "use_ops"))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        attn_meta: Any,  # kernels.AttentionMetadata
        logits_indices: torch.Tensor,  # [R] int64: rows whose next-token logits are needed
        pool_indices: torch.Tensor | None = None,  # [P] int64: rows whose final normed hidden state is needed
    ) -> torch.Tensor | None:  # [R, vocab] float32 (None on tensor-parallel ranks other than 0)
        """With `pool_indices`: (logits, [P, hidden] hidden states after the last norm) (embeddings)."""
        h = self.embed_tokens(input_ids)  # a fresh tensor: the residual adds may update it in place
        steps = [rotary.prepare(positions) for rotary in self.rotaries]
        for i, layer in enumerate(self.layers):
            if self.capture is not None:  # an EAGLE-3 head reads some layers' inputs
                self.capture.layer_input(i, h)
            h = self.layer_forward(i, layer, h, kv_cache, attn_meta, steps[self.rope_of_layer[i]])
        if self.capture is not None:
            self.capture.layer_input(len(self.layers), h)
        return self.head(h, logits_indices, pool_indices)

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None):
        """forward's result from the last layer's hidden states h: the logits of rows `logits_indices` (gathered
        on rank 0 under tensor parallelism, None on the others), and with `pool_indices` those rows' normed states."""
        pooled = None if pool_indices is None else self.final_norm(h[pool_indices])
        if self.capture is not None and self.capture.final:  # an MTP head reads every row's normed state
            self.capture.last = self.final_norm(h)
        # The head is the most expensive matmul per row: run it only where a token is sampled.
        logits = self.final_logits(self.ops.linear(self.final_norm(h[logits_indices]), self.lm_head)).float()
        if self.tp is not None:
            logits = self.tp.gather_to_first(logits)  # [R, size * vocab rows] on rank 0, padding rows last
            logits = None if logits is None else logits[:, : self.config.vocab_size]
        return logits if pooled is None else (logits, pooled)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(h, self.norm)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output before it turns float32 (Gemma soft-caps it here)."""
        return logits

    def layer_forward(self, i: int, layer: LayerWeights, h: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                      rope: Any) -> torch.Tensor:
        """Decoder layer i of h [T, hidden]; `rope`: the step's `Rotary.prepare` of this layer's rotary."""
        qk, v = self.attention_inputs(i, layer, h, rope)
        return self.post_attention(i, layer, self.paged_attention(i, qk, v, kv_cache, attn_meta), h)

    def attention_inputs(self, i: int, layer: LayerWeights, h: torch.Tensor,
                         rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k heads [T, Hq + Hkv, D], roped (per-head normed first where the layer has q/k norms, as
        Qwen3), and v [T, Hkv, D]."""
        c, num_tokens = self.config, h.shape[0]
        x = self.ops.rms_norm(h, layer.input_norm)
        qkv = self.ops.linear(x, layer.qkv, layer.qkv_bias)
        self.add_lora(i, "qkv", x, qkv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Rope on q and k heads together (adjacent in qkv): 4 ops instead of 12.
        qk = qk.view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        if layer.qk_norm is not None:
            qk = head_rms_norm(qk, layer.qk_norm, c.rms_norm_eps)
        return self.ops.rope(qk, rope), v.view(num_tokens, c.num_kv_heads, c.head_dim)

    def post_attention(self, i: int, layer: LayerWeights, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + o-proj of the attention output o [T, Hq * D], then + the feed-forward."""
        return self.feed_forward(i, layer, self.reduce(self.attention_output(i, layer, o, h)))

    def attention_output(self, i: int, layer: LayerWeights, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of h + o @ o_w.T + o_b (`row_parallel_add`)."""
        return self.row_parallel_add(i, "o", o, layer.o, layer.o_bias, h)

    def feed_forward(self, i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """h + layer i's feed-forward of h post-attention-normed, summed over ranks; sparse families override it."""
        return self.reduce(self.mlp(i, layer, h))

    def mlp(self, i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of h + the SwiGLU MLP of h post-attention-normed."""
        x = self.ops.rms_norm(h, layer.post_norm)
        gate, up = self.ops.linear(x, layer.gate), self.ops.linear(x, layer.up)
        self.add_lora(i, "gate", x, gate)
        self.add_lora(i, "up", x, up)
        return self.row_parallel_add(i, "down", self.ops.silu_mul(gate, up), layer.down, None, h)

    def row_parallel_add(self, i: int, group: str, x: torch.Tensor, weight: Any, bias: torch.Tensor | None,
                         residual: torch.Tensor) -> torch.Tensor:
        """This rank's part of residual + x @ weight.T + bias, where weight holds this rank's input columns: rank 0
        adds the residual and the bias into its partial product, the others give theirs; `reduce` sums them. Each
        rank adds its partial LoRA delta of (layer i, group): its A holds the same input columns, so the sum over
        ranks is the whole delta."""
        out = self.ops.linear_add(x, weight, bias, residual) if self.first_rank else self.ops.linear(x, weight)
        self.add_lora(i, group, x, out)  # out holds the residual: adding the delta is the same
        return out

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the tensor-parallel ranks (in place); t itself on one rank."""
        if self.tp is not None:
            self.tp.all_reduce(t)
        return t

    def add_lora(self, i: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.lora is not None:
            self.lora.add(i, group, x, out)

    def _feed_forward_weights(self, i: int, weights: dict, w: Callable, mat: Callable) -> dict[str, Any]:
        """Layer i's feed-forward fields of LayerWeights, from `weights` through the constructor's `w` (to the
        device and dtype) and `mat` (a matmul weight): here the dense SwiGLU MLP; sparse families override it."""
        mlp = f"model.layers.{i}.mlp."
        return {x: mat(w(mlp + f"{x}_proj.weight")) for x in ("gate", "up", "down")}

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of input_ids, a fresh tensor (the families that scale them do it here)."""
        if isinstance(self.embed, QuantizedWeight):  # dequantize only the rows looked up
            return self.embed.rows(input_ids, self.dtype)
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        # Each rank looks up the ids in its range (zeros elsewhere); the sum over ranks is the embedding.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.tp.all_reduce(h)
        return h

    __call__ = forward


@dataclass
class DecoderOps:
    """The layer ops a Llama-shaped layer calls, each built for the model's mode."""

    rms_norm: RMSNorm
    linear: Linear
    linear_add: LinearAdd
    silu_mul: SiluAndMul
    rope: Rotary  # applies any of the model's `rotaries`' prepared steps
