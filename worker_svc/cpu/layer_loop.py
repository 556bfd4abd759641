"""The decoder layers of a `LlamaModel` in one C++ call (kernels/csrc/decoder_layers.cpp), for CPU steps whose
attention runs entirely in the decode kernel: every decode step, and prefill chunks of short sequences. The runner
asks `build` whether a model's layers can run here and then calls the `LayerLoop`; the model knows nothing of it.

The C++ loop calls the kernels the Python loop calls, in the same order, so the hidden states are bit-identical; it
saves the Python and torch dispatch around them (about 2 ms of a 10 ms batch-1 step of SmolLM2-135M on two cores,
~40 us a layer) and runs without the GIL. Built only where the Python loop would run nothing else: float32 or bfloat16
with every matmul weight in panels, on the quantized CPU kernels (GGUF int4 / int8, an HF checkpoint's FP8) or
(bfloat16) a plain or oneDNN-prepacked tensor,
no biases, q/k norms, sliding windows, soft-capping,
sparse layers, tensor parallelism or family overrides (`LlamaModel.runs_llama_layers`); per step, no LoRA adapters.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.reference import ReferencePlan, paged_attention
from worker_svc.cpu.panel_linear import PANEL_WIDTH, PanelLinear
from worker_svc.model.quant import QuantLinear

TORCH = 3  # the C++ Matmul kind of a bfloat16 tensor: oneDNN's matmul for a prepacked copy, F.linear for a plain one
SWIGLU = 4  # gate's and up's bfloat16 panels interleaved: the matmul gives silu(gate) * up (dense_swiglu)
FP8 = 5  # an FP8 checkpoint's codes and block scales (fp8_matmul)


def _form(weight: Any) -> tuple[int, tuple[str, ...]] | None:
    """(the C++ Matmul kind, the weight's tensor attributes it takes) for a matmul weight the C++ loop runs, else
    None: float32 or bfloat16 panels, int4 / int8 groups or FP8 codes on the project's CPU kernels with float32 or
    bfloat16 activations, or a bfloat16 CPU tensor (no attributes: the weight is the tensor)."""
    if isinstance(weight, PanelLinear):
        return 0, ("panels",)
    if isinstance(weight, QuantLinear) and weight.ops is not None and weight.dtype in (torch.float32, torch.bfloat16):
        if weight.is_fp8:
            return FP8, ("codes", "scale")
        return (1, ("codes", "scale", "zero")) if weight.bits == 4 else (2, ("codes", "scale"))
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return TORCH, ()
    return None


def _cpp(ops: Any, kind: int, tensors: list[torch.Tensor], out_features: int, activation_bits: int,
         group: int = 0) -> Any:
    padded = [*tensors, *[None] * (3 - len(tensors))]  # weight, scale, zero
    return ops.Matmul(kind, *padded, out_features, activation_bits, group)  # group: an FP8 scale's columns


def _matmul(ops: Any, weight: Any) -> Any | None:
    """The C++ form of one matmul weight, or None where the C++ loop cannot run it."""
    if (form := _form(weight)) is None:
        return None
    kind, names = form
    if kind == TORCH:
        return _cpp(ops, kind, [weight], weight.shape[0], 0)
    return _cpp(ops, kind, [getattr(weight, n) for n in names], weight.out_features,
                getattr(weight, "activation_bits", 0), weight.group if kind == FP8 else 0)


def _gate_up(ops: Any, gate: Any, up: Any) -> Any | None:
    """gate's and up's weights as one matmul of both outputs (one pass over x, one parallel region, with integer
    activations x quantized once), or (bfloat16 panels) one whose output is silu(gate) * up; gate and up then hold
    views of the joined tensors, so nothing is stored twice. Only where the intermediate size is a multiple of the
    panel width (whole panels; silu over a half of each row then runs the vector loop the separate tensor does, the
    same bits)."""
    form = _form(gate)
    bits = getattr(gate, "activation_bits", 0)
    if form is None or form[0] == TORCH or form != _form(up) or bits != getattr(up, "activation_bits", 0) \
            or gate.in_features != up.in_features or getattr(gate, "group", 0) != getattr(up, "group", 0) \
            or gate.out_features % getattr(gate, "panel_width", PANEL_WIDTH[torch.float32]):
        return None
    kind, names = form
    if kind == 0 and gate.dtype == torch.bfloat16:
        # gate's panel j next to up's: each tile of the kernel holds both for the same outputs and writes silu(gate)
        # * up, the bits of the two matmuls and silu_mul_, in one pass and without the [rows, 2 x inter] output
        both = torch.stack([gate.panels, up.panels], dim=1).flatten(0, 1)
        gate.panels, up.panels = both[0::2], both[1::2]
        return _cpp(ops, SWIGLU, [both], gate.out_features, 0)
    joined = []
    for name in names:
        both = torch.cat([getattr(gate, name), getattr(up, name)])
        split = getattr(gate, name).shape[0]
        setattr(gate, name, both[:split])
        setattr(up, name, both[split:])
        joined.append(both)
    return _cpp(ops, kind, joined, gate.out_features + up.out_features, bits, gate.group if kind == FP8 else 0)


def build(model: Any) -> LayerLoop | None:
    """The layers of `model` (a worker_svc.model.decoder.LlamaModel) in the C++ loop, or None where its forward needs
    the Python loop."""
    ops = model.cpu_ops
    if (ops is None or not hasattr(ops, "DecoderLayers") or not model.runs_llama_layers()
            or model.dtype not in (torch.float32, torch.bfloat16)
            or model.tp is not None
            or model.attention.paged_attention is not paged_attention or any(model.attn_kwargs)):
        return None
    c = model.config
    layers = ops.DecoderLayers(c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, model.scale,
                               model.cos_cache, model.sin_signed_cache)
    for layer in model.layers:
        if layer.qkv_bias is not None or layer.o_bias is not None or layer.qk_norm is not None \
                or layer.moe is not None or layer.gate is None:
            return None
        # gate and up joined, or (oneDNN's packed copies cannot be joined) each on its own
        joined = _gate_up(ops, layer.gate, layer.up)
        gate_up, up = (joined, None) if joined is not None else (_matmul(ops, layer.gate), _matmul(ops, layer.up))
        mats = [_matmul(ops, layer.qkv), _matmul(ops, layer.o), gate_up, _matmul(ops, layer.down)]
        if any(m is None for m in mats) or (joined is None and up is None):
            return None
        qkv, o, gate_up, down = mats
        layers.add_layer(layer.input_norm, qkv, o, layer.post_norm, gate_up, down, up)
    return LayerLoop(model, layers)


class LayerLoop:
    """`model.forward` with the decoder layers in one C++ call where the step allows it (bit-identical to the Python
    loop), the model's own forward elsewhere; the model's other attributes pass through."""

    def __init__(self, model: Any, layers: Any):
        self.model = model
        self.layers = layers  # the C++ DecoderLayers

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None) -> Any:
        rows = None if self.model.lora is not None else kernel_rows(attn_meta.plan, input_ids.shape[0])
        if rows is None:
            return self.model.forward(input_ids, positions, kv_cache, attn_meta, logits_indices, pool_indices)
        h = self.layers.forward(self.model.embed_tokens(input_ids), positions.to(torch.int64).contiguous(), kv_cache,
                                attn_meta.slot_mapping, rows.rows, rows.tables, rows.seq_lens)
        return self.model.head(h, logits_indices, pool_indices)

    def __getattr__(self, name: str):  # the model's other attributes (config, kv_cache_shape, ...)
        return getattr(self.model, name)

    __call__ = forward




def kernel_rows(plan: Any, num_tokens: int) -> Any | None:
    """The step's attention rows when the decode kernel serves all of them (the C++ loop's condition), else None."""
    if not isinstance(plan, ReferencePlan) or plan.groups or plan.empty_rows is not None:
        return None
    rows = plan.kernel_rows
    return rows if rows is not None and len(rows.rows) == num_tokens else None
