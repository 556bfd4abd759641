"""compressed-tensors' integer formats as the project's quantized weights (quant.QuantizedWeight).

`pack-quantized` (W4A16, e.g. llm-compressor's GPTQ / AWQ recipes): per linear layer `weight_packed` int32
[out, in / 8] (the signed 4-bit codes plus 8, nibble i of word k holding input column 8k + i), `weight_scale`
[out, groups] (strategy `group`: one per `group_size` input columns; `channel`: one per row), `weight_shape`
[out, in], and where asymmetric `weight_zero_point` (signed plus 8, packed 8 per int32 along the output dim);
w = (q - zero) * scale. In the unsigned codes the kernels hold that is (u - z) * scale with z = 8 where symmetric:
a group is whole 32-groups with one scale and offset, so the conversion is exact.

`int-quantized` (W8A8 int8, e.g. llm-compressor's SmoothQuant + GPTQ recipes): `weight` int8 [out, in] and
`weight_scale` per output channel (or per tensor), symmetric; w = q * scale. That is the project's int8 weight
(a scale per 32-group: the row's scale repeated), exact. The checkpoint's dynamic per-token int8 activation scales
are a kernel's choice: activations run in --dtype by default (--activation-quantization int8 makes each 32-group
of a matmul's input int8 on the CPU kernels, a finer grain than per token); static input scales are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from worker_svc.model.hf_gptq import unpack_columns, unpack_rows
from worker_svc.model.quant import GROUP, QuantizedWeight

INT_FORMATS = ("pack-quantized", "int-quantized")


def check_int_weights(fmt: str, weights: dict, acts: dict | None, where: str, refuse) -> None:
    """Refuse a config group's `weights` / `input_activations` that the `fmt` conversion does not apply."""
    packed = fmt == "pack-quantized"
    for key, allowed in (("num_bits", (4,) if packed else (8,)), ("type", ("int",)),
                         ("strategy", ("group", "channel") if packed else ("channel", "tensor")),
                         ("symmetric", (True, False) if packed else (True,)), ("dynamic", (False,)),
                         ("actorder", (None, "weight", "static"))):
        if weights.get(key) not in allowed:
            raise refuse(f"{where}.weights.{key}", weights.get(key), f"one of {allowed}")
    group = weights.get("group_size")
    if weights["strategy"] == "group" and not (isinstance(group, int) and group > 0 and group % GROUP == 0):
        raise refuse(f"{where}.weights.group_size", group, f"a multiple of {GROUP}")
    if acts and packed:
        raise refuse(f"{where}.input_activations", acts, "none only: pack-quantized is weight-only (W4A16)")
    if acts:
        for key, allowed in (("num_bits", (8,)), ("type", ("int",)), ("dynamic", (True,))):
            if acts.get(key) not in allowed:
                raise refuse(f"{where}.input_activations.{key}", acts.get(key),
                             f"one of {allowed} (dynamic int8 activations; static input scales are not read)")


def packed_weight(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, zero_point: torch.Tensor | None,
                  name: str) -> QuantizedWeight:
    """One layer's pack-quantized tensors as an int4 QuantizedWeight [out, in] with 32-groups."""
    out, inp = (int(v) for v in shape.tolist())
    codes = unpack_columns(packed)[:out, :inp].contiguous()
    scale = scale.float().reshape(out, -1)
    groups = scale.shape[1]
    if inp % groups or (inp // groups) % GROUP:
        raise ValueError(f"{name}: {inp} input columns in {groups} groups is not a whole number of "
                         f"{GROUP}-column groups")
    zero = torch.full_like(scale, 8.0) if zero_point is None else unpack_rows(zero_point)[:out].float()
    repeat = inp // groups // GROUP
    return QuantizedWeight(codes, scale.repeat_interleave(repeat, 1).contiguous(),
                           (-zero * scale).repeat_interleave(repeat, 1).contiguous(), 4, "compressed-tensors")


def convert_pack_quantized(tensors: Mapping[str, torch.Tensor], keep_quantized: Callable[[str], bool],
                           put_quantized: Callable[[str, QuantizedWeight], Any],
                           put: Callable[[str, torch.Tensor], Any]) -> dict:
    """The model's weights from a pack-quantized checkpoint, one layer at a time: each `weight_packed` (with its
    scale, shape and zero point) becomes `<layer>.weight`, int4 and given to `put_quantized(name, weight)` where
    `keep_quantized(name)` (the model packs it), else float32 dequantized and given to `put(name, tensor)` like
    every other tensor; what they return is kept."""
    out: dict = {}
    for name in tensors:
        if name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        if name.endswith(".weight_g_idx"):
            raise ValueError(f"{name}: group act-order (a g_idx) is not read by llmserve")
        t = tensors[name]
        if name.endswith(".weight_packed"):
            layer = name.removesuffix("_packed")
            w = packed_weight(t, tensors[layer + "_scale"], tensors[layer + "_shape"],
                              tensors.get(layer + "_zero_point"), name)
            out[layer] = put_quantized(layer, w) if keep_quantized(layer) else put(layer, w.dequantize())
            del w
        else:
            out[name] = put(name, t)
        del t  # the source goes before the next tensor is read
    return out


def int8_weight(weight: torch.Tensor, scale: torch.Tensor, name: str) -> QuantizedWeight:
    """One layer's int-quantized tensors as an int8 QuantizedWeight [out, in] with a scale per 32-group."""
    if weight.dtype != torch.int8:
        raise ValueError(f"{name}: an int-quantized weight must be int8; it is {weight.dtype}")
    out, inp = weight.shape
    if inp % GROUP:
        raise ValueError(f"{name}: {inp} input columns is not a multiple of {GROUP}")
    scale = scale.float().reshape(-1, 1)
    if scale.shape[0] not in (1, out):
        raise ValueError(f"{name}: weight_scale of {scale.shape[0]} values fits neither a tensor nor {out} channels")
    return QuantizedWeight(weight, scale.expand(out, inp // GROUP).contiguous(), None, 8, "compressed-tensors")


def convert_int_quantized(tensors: Mapping[str, torch.Tensor], keep_quantized: Callable[[str], bool],
                          put_quantized: Callable[[str, QuantizedWeight], Any],
                          put: Callable[[str, torch.Tensor], Any]) -> dict:
    """The model's weights from an int-quantized checkpoint, one layer at a time: each int8 `weight` with its
    `weight_scale` becomes an int8 QuantizedWeight given to `put_quantized(name, weight)` where
    `keep_quantized(name)`, else float32 dequantized and given to `put(name, tensor)` like every other tensor;
    what they return is kept."""
    out: dict = {}
    for name in tensors:
        if name.endswith(".weight_scale"):
            continue
        if name.endswith((".input_scale", ".input_zero_point")):
            raise ValueError(f"{name}: static activation scales are not read by llmserve")
        t = tensors[name]
        if name.endswith(".weight_zero_point"):
            if t.any():
                raise ValueError(f"{name}: asymmetric int8 weights are not read by llmserve")
        elif t.dtype == torch.int8:
            scale = tensors.get(name + "_scale")
            if scale is None:
                raise ValueError(f"{name} is int8 but the checkpoint has no {name}_scale")
            w = int8_weight(t, scale, name)
            out[name] = put_quantized(name, w) if keep_quantized(name) else put(name, w.dequantize())
            del w
        else:
            out[name] = put(name, t)
        del t  # the source goes before the next tensor is read
    return out
