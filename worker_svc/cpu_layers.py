"""The decoder layers of a `LlamaModel` in one C++ call (kernels/csrc/decoder_layers.cpp), for CPU steps whose
attention runs entirely in the decode kernel: every decode step, and prefill chunks of short sequences.

The C++ loop calls the kernels the Python loop calls, in the same order, so the hidden states are bit-identical; it
saves the Python and torch dispatch around them (about 2 ms of a 10 ms batch-1 step of SmolLM2-135M on two cores,
~40 us a layer) and runs without the GIL. Built only where the Python loop would run nothing else: float32, every
matmul weight in panels or on the quantized CPU kernels, no biases, q/k norms, sliding windows, soft-capping,
sparse layers, tensor parallelism or family overrides; per step, no LoRA adapters.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.reference import ReferencePlan, paged_attention
from worker_svc.panel_linear import PanelLinear
from worker_svc.quant import QuantLinear


def _matmul(ops: Any, weight: Any) -> Any | None:
    """The C++ form of one matmul weight, or None where the C++ loop cannot run it."""
    if isinstance(weight, PanelLinear):
        return ops.Matmul(0, weight.panels, out_features=weight.out_features)
    if isinstance(weight, QuantLinear) and weight.ops is not None and weight.dtype == torch.float32:
        if weight.bits == 4:
            return ops.Matmul(1, weight.codes, weight.scale, weight.zero, weight.out_features, weight.activation_bits)
        return ops.Matmul(2, weight.codes, weight.scale, None, weight.out_features, weight.activation_bits)
    return None


def build(model: Any) -> Any | None:
    """The layers of `model` (a worker_svc.model.LlamaModel whose family overrides none of its layer code) as one C++
    object (`forward(h, positions, kv_cache, slot_mapping, rows, tables, seq_lens)`), or None where its forward
    needs the Python loop."""
    ops = model.cpu_ops
    if (ops is None or not hasattr(ops, "DecoderLayers") or model.dtype != torch.float32 or model.tp is not None
            or model.attention.paged_attention is not paged_attention or any(model.attn_kwargs)):
        return None
    c = model.config
    layers = ops.DecoderLayers(c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, model.scale,
                               model.cos_cache, model.sin_signed_cache)
    for layer in model.layers:
        if layer.qkv_bias is not None or layer.o_bias is not None or layer.qk_norm is not None \
                or layer.moe is not None or layer.gate is None:
            return None
        mats = [_matmul(ops, getattr(layer, name)) for name in ("qkv", "o", "gate", "up", "down")]
        if any(m is None for m in mats):
            return None
        qkv, o, gate, up, down = mats
        layers.add_layer(layer.input_norm, qkv, o, layer.post_norm, gate, up, down)
    return layers


def kernel_rows(plan: Any, num_tokens: int) -> Any | None:
    """The step's attention rows when the decode kernel serves all of them (the C++ loop's condition), else None."""
    if not isinstance(plan, ReferencePlan) or plan.groups or plan.empty_rows is not None:
        return None
    rows = plan.kernel_rows
    return rows if rows is not None and len(rows.rows) == num_tokens else None
