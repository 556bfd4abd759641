"""The Llama-shaped decoder over a paged KV cache, and the layer functions every family shares.

`LlamaModel` runs Llama, Mistral, Qwen2 and Qwen3 (q/k norm); other families (worker_svc/model/families/) subclass it.

One forward runs one flattened batch: prefill chunks and decode tokens of many sequences are
concatenated into `num_tokens` rows. Everything except attention is per-token, so only
attention needs to know about sequences; it gets that from `attn_meta` (kernels.AttentionMetadata).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_ops
from worker_svc.cpu import layer_loop as cpu_layers
from worker_svc.cpu.panel_linear import PanelLinear
from worker_svc.model.config import ModelConfig
from worker_svc.model.quant import QuantizedWeight, QuantLinear, cat_rows, check_activation_dtype


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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX). Without them oneDNN emulates bf16
    and float32 is as fast and more exact."""
    return bool(cpu_ops.cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes float16 natively (AVX512-FP16 or AMX-FP16); without them torch converts every
    float16 operand to float32 and back."""
    return bool(cpu_ops.cpu_flags() & {"avx512_fp16", "amx_fp16"})


def panels_available(dtype: torch.dtype) -> bool:
    """Whether matmuls of `dtype` can run the project's panel kernel (kernels/csrc/dense_matmul.cpp): float32 with
    AVX2 + FMA, bfloat16 with AVX512-BF16."""
    if dtype not in (torch.float32, torch.bfloat16) or (ops := cpu_ops.load()) is None \
            or not hasattr(ops, "dense_matmul"):
        return False
    return dtype == torch.float32 or bool(getattr(ops, "dense_bfloat16", False))


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matmul weights can be packed for the CPU (`pack_linear_weight`): float32 and bfloat16 in the project's
    panels where that kernel is built, else with oneDNN (bfloat16 only on a CPU with native bf16).

    On CPU, F.linear goes to MKL's sgemm, which (measured on an AMD EPYC) runs 2-3x slower than oneDNN for
    the batch sizes a worker sees (8..512 rows); oneDNN also reads its blocked weight layout faster at 1 row
    (bfloat16: the 49152 x 576 head at 1 row 2.4x faster packed than F.linear).
    Set LLMSERVE_PREPACK_LINEAR=0 to turn it off.
    """
    if device.type != "cpu" or os.environ.get("LLMSERVE_PREPACK_LINEAR", "1") == "0":
        return False
    if panels_available(dtype):
        return True
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the ops are internal (TorchInductor's CPU freezing path): check they exist and agree with F.linear
        w = torch.linspace(-1, 1, 24 * 40).reshape(24, 40).sin().to(dtype)  # no global RNG use
        x = torch.linspace(-2, 2, 3 * 40).reshape(3, 40).cos().to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, prepack_linear_weight(w), None, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=tol, atol=tol / 10))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [out, in] float32/bfloat16 CPU weight in oneDNN's blocked layout (`weight.is_mkldnn`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | PanelLinear:
    """A [out, in] CPU weight in the layout its matmul runs fastest from: the project's panels where that kernel is
    built for its dtype (float32: it beat oneDNN at 1 to 1024 rows on SmolLM2's shapes; bfloat16: 1.3-2x at 1-16
    rows, 1.0-1.3x at 64-256), else oneDNN's blocked copy."""
    if panels_available(weight.dtype):
        return PanelLinear(weight, cpu_ops.load())
    return prepack_linear_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor | PanelLinear | QuantLinear,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for a dense, a packed or a quantized weight."""
    if isinstance(weight, PanelLinear):
        return weight(x, bias)
    if isinstance(weight, QuantLinear):
        y = weight(x)
        return y if bias is None else y.add_(bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: torch.Tensor | PanelLinear | QuantLinear, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T + bias: fused into the matmul for panels (float32 or bfloat16) and for a packed or a
    quantized float32 weight (the same result as a separate add), in place into `residual` otherwise. oneDNN's and
    the quantized kernels' fused add in bfloat16 would round once where Hugging Face rounds the product and then the
    sum (the bfloat16 panel kernel rounds twice, as the separate add does)."""
    if isinstance(weight, PanelLinear):
        return weight(x, bias, residual)
    if isinstance(weight, torch.Tensor) and weight.is_mkldnn and weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    if isinstance(weight, QuantLinear) and bias is None and weight.fuses_residual(x):
        return weight(x, residual)
    return residual.add_(linear(x, weight, bias))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: ModuleType | None = None) -> torch.Tensor:
    """`ops`: the C++ module where the caller holds it (the model: no look-up per call); None looks it up."""
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 \
            and x.device.type == "cpu" and (ops := ops or cpu_ops.load()) is not None \
            and not torch.compiler.is_compiling():
        # the composite below in one pass: the same roundings, the float32 sum of squares in another order
        return ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused kernel instead of six ops; bit-identical to the composite below in float32.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Statistics in float32 so bf16/fp16 activations don't lose precision; same cast order as HF.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, H, D] with per-head weights [H, D] (q and k heads normalized in one call)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(config: ModelConfig, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2], float32, with the config's scaling applied (`scaled`)."""
    dim = config.head_dim
    theta = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling if scaled else None
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type == "linear":
        # Position interpolation: pos / factor, folded into the frequencies.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":
        # llama.cpp's form of llama3 scaling: a per-frequency divisor stored in the GGUF.
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: expected linear, llama3 or none")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly between the two.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_position: int, dtype: torch.dtype, device: torch.device,
                theta: float | None = None, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-flipped sin [max_position, head_dim] for rope as x * cos + swap_halves(x) * sin_signed,
    computed in float32 then cast (as HF does per step)."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope_inv_freq(config, theta, scaled))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(device=device, dtype=dtype)
    sin = emb.sin().to(device=device, dtype=dtype)
    half = config.head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from the config's layer_types."""
    types = config.layer_types or ["full_attention"] * config.num_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] along the last dim, in one copy. With sin's first half negated,
    swap_halves(x) * sin == cat(-x2, x1) * sin exactly (only signs move): HF's rotate_half, without the negation."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


class Collectives(Protocol):
    """What a tensor-parallel rank's model needs from its process group (worker_svc.parallel.RankGroup)."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> None: ...  # in place, sum over ranks

    def gather_to_first(self, t: torch.Tensor) -> torch.Tensor | None: ...  # cat on the last dim, rank 0 only


class LlamaModel:
    """Inference-only decoder. Weights are plain tensors; there is no autograd anywhere.

    With `tp`, this is one rank of a tensor-parallel group: `config` is the rank's local config
    (tensor_parallel.local_config) and `weights` its shard (tensor_parallel.shard_weights); `forward` returns
    the logits on rank 0 and None on the others.
    """

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
        self.dtype = dtype
        self.device = torch.device(device)
        if prepack is None:
            prepack = prepack_supported(self.device, dtype)
        self.prepacked = prepack
        # Multi-LoRA (worker_svc/lora.LoraPool): each projection adds lora.add(layer, group, x, out); None: off.
        self.lora: Any = None
        # Anything with write_kv_cache / paged_attention (the torch reference or a Triton backend).
        self.attention = attention if attention is not None else kernels
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # Per layer: the attention backend's keyword arguments beyond the defaults (a sliding window, soft-capping).
        self.attn_kwargs: list[dict] = [
            {k: v for k, v in (("sliding_window", wnd), ("softcap", config.attn_logit_softcapping)) if v}
            for wnd in layer_windows(config)]
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
            """A matmul weight; the dense copy is dropped once packed."""
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
        # The C++ CPU kernels (rope in place, and rms_norm / decode attention through their callers), or None.
        self.cpu_ops = cpu_ops.load() if self.device.type == "cpu" else None
        # The decoder layers as one C++ call where the step allows it (worker_svc/cpu/layer_loop.py), or None; not for
        # a family that overrides the layer code.
        own_layers = all(getattr(type(self), f) is getattr(LlamaModel, f)
                         for f in ("forward", "_layers", "_feed_forward", "_row_parallel_add"))
        self.cpu_layers = cpu_layers.build(self) if own_layers else None

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
        h = self._embed(input_ids)  # a fresh tensor: linear_add may update it in place
        rows = None if self.cpu_layers is None or self.lora is not None else \
            cpu_layers.kernel_rows(attn_meta.plan, input_ids.shape[0])
        if rows is not None:  # the loop below in one C++ call, bit-identical
            h = self.cpu_layers.forward(h, positions.to(torch.int64).contiguous(), kv_cache, attn_meta.slot_mapping,
                                        rows.rows, rows.tables, rows.seq_lens)
        else:
            h = self._layers(h, positions, kv_cache, attn_meta)

        return self.head(h, logits_indices, pool_indices)

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None):
        """forward's result from the last layer's hidden states h: the logits of rows `logits_indices` (gathered
        on rank 0 under tensor parallelism, None on the others), and with `pool_indices` those rows' normed states."""
        c = self.config
        pooled = None if pool_indices is None else rms_norm(h[pool_indices], self.norm, c.rms_norm_eps)
        # The head is the most expensive matmul per row: run it only where a token is sampled.
        h = rms_norm(h[logits_indices], self.norm, c.rms_norm_eps)
        logits = linear(h, self.lm_head).float()
        if self.tp is not None:
            logits = self.tp.gather_to_first(logits)  # [R, size * vocab rows] on rank 0, padding rows last
            logits = None if logits is None else logits[:, : c.vocab_size]
        return logits if pooled is None else (logits, pooled)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any) -> torch.Tensor:
        """h [T, hidden] (the embeddings) through every decoder layer."""
        c = self.config
        num_tokens = h.shape[0]
        if self.cpu_ops is not None:
            positions = positions.to(torch.int64).contiguous()
        else:
            cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D], broadcast over heads
            sin = self.sin_signed_cache[positions].unsqueeze(1)
        qk_heads = c.num_heads + c.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps, self.cpu_ops)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            if self.lora is not None:
                self.lora.add(i, "qkv", x, qkv)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Rope on q and k heads together (adjacent in qkv): 4 ops instead of 12. q and k come out as
            # strided views of one tensor, which the attention backends accept.
            qk = qk.view(num_tokens, qk_heads, c.head_dim)
            if layer.qk_norm is not None:
                qk = head_rms_norm(qk, layer.qk_norm, c.rms_norm_eps)
            if self.cpu_ops is not None:
                self.cpu_ops.rope_(qk, positions, self.cos_cache, self.sin_signed_cache)
            else:
                qk = qk * cos + swap_halves(qk) * sin
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = v.view(num_tokens, c.num_kv_heads, c.head_dim)

            key_cache, value_cache = kv_cache[i, 0], kv_cache[i, 1]
            self.attention.write_kv_cache(k, v, key_cache, value_cache, attn_meta.slot_mapping)
            o = self.attention.paged_attention(
                q,
                key_cache,
                value_cache,
                attn_meta.block_tables,
                attn_meta.cu_seqlens_q,
                attn_meta.seq_lens,
                self.scale,
                plan=attn_meta.plan,
                **self.attn_kwargs[i],
            )
            o = o.reshape(num_tokens, self.q_size)
            h = self._row_parallel_add(o, layer.o, layer.o_bias, h, (i, "o"))

            h = self._feed_forward(i, layer, rms_norm(h, layer.post_norm, c.rms_norm_eps, self.cpu_ops), h)
        return h

    def _feed_forward_weights(self, i: int, weights: dict, w: Callable, mat: Callable) -> dict[str, Any]:
        """Layer i's feed-forward fields of LayerWeights, from `weights` through the constructor's `w` (to the
        device and dtype) and `mat` (a matmul weight): here the dense SwiGLU MLP; sparse families override it."""
        mlp = f"model.layers.{i}.mlp."
        return {x: mat(w(mlp + f"{x}_proj.weight")) for x in ("gate", "up", "down")}

    def _feed_forward(self, i: int, layer: LayerWeights, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + layer i's feed-forward of x (the post-attention-normed hidden states)."""
        gate, up = linear(x, layer.gate), linear(x, layer.up)
        if self.lora is not None:
            self.lora.add(i, "gate", x, gate)
            self.lora.add(i, "up", x, up)
        if self.cpu_ops is not None and gate.dtype == torch.bfloat16 and gate.dim() == 2:
            self.cpu_ops.silu_mul_(gate, up)  # the two ops below in one pass, same roundings
            act = gate
        else:
            act = F.silu(gate, inplace=True).mul_(up)  # in place: two fewer allocations
        return self._row_parallel_add(act, layer.down, None, residual, (i, "down"))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
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

    def _row_parallel_add(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          residual: torch.Tensor, lora_at: tuple[int, str] | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias where weight holds this rank's input columns: rank 0 adds the residual
        and the bias into its partial product, the others contribute theirs, one all-reduce sums them. With
        `lora_at` (layer, group) each rank adds its partial LoRA delta before the reduce: its A holds the same input
        columns, so the sum over ranks is the whole delta."""
        first = self.tp is None or self.tp.rank == 0
        out = linear_add(x, weight, bias, residual) if first else linear(x, weight)
        if self.lora is not None and lora_at is not None:  # out holds the residual: adding the delta is the same
            self.lora.add(*lora_at, x, out)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out

    __call__ = forward
