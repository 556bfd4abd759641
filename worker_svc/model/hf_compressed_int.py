"""compressed-tensors' integer formats as the project's quantized weights (quant.QuantizedWeight).

`pack-quantized` (W4A16, e.g. llm-compressor's GPTQ / AWQ recipes): per linear layer `weight_packed` int32
[out, in / 8] (the signed 4-bit codes plus 8, nibble i of word k holding input column 8k + i), `weight_scale`
[out, groups] (strategy `group`: one per `group_size` input columns; `channel`: one per row), `weight_shape`
[out, in], and where asymmetric `weight_zero_point` (signed plus 8, packed 8 per int32 along the output dim);
w = (q - zero) * scale. In the unsigned codes the kernels hold that is (u - z) * scale with z = 8 where symmetric:
a group is whole 32-groups with one scale and offset, so the conversion is exact.
"""

from __future__ import annotations

import torch

from worker_svc.model.hf_gptq import unpack_columns, unpack_rows
from worker_svc.model.quant import GROUP, QuantizedWeight

INT_FORMATS = ("pack-quantized",)


def check_int_weights(fmt: str, weights: dict, acts: dict | None, where: str, refuse) -> None:
    """Refuse a config group's `weights` / `input_activations` that the `fmt` conversion does not apply."""
    for key, allowed in (("num_bits", (4,)), ("type", ("int",)), ("strategy", ("group", "channel")),
                         ("symmetric", (True, False)), ("dynamic", (False,)), ("actorder", (None, "weight", "static"))):
        if weights.get(key) not in allowed:
            raise refuse(f"{where}.weights.{key}", weights.get(key), f"one of {allowed}")
    group = weights.get("group_size")
    if weights["strategy"] == "group" and not (isinstance(group, int) and group > 0 and group % GROUP == 0):
        raise refuse(f"{where}.weights.group_size", group, f"a multiple of {GROUP}")
    if acts:
        raise refuse(f"{where}.input_activations", acts, "none only: pack-quantized is weight-only (W4A16)")


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


def convert_pack_quantized(tensors: dict[str, torch.Tensor], keep_quantized) -> dict:
    """The model's weights from a pack-quantized checkpoint: each `weight_packed` (with its scale, shape and zero
    point) becomes `<layer>.weight`, int4 where `keep_quantized(name)` (the model packs it), else float32
    dequantized; the rest float32."""
    out: dict = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        if name.endswith(".weight_g_idx"):
            raise ValueError(f"{name}: group act-order (a g_idx) is not read by llmserve")
        if name.endswith(".weight_packed"):
            layer = name.removesuffix("_packed")
            w = packed_weight(t, tensors[layer + "_scale"], tensors[layer + "_shape"],
                              tensors.get(layer + "_zero_point"), name)
            out[layer] = w if keep_quantized(layer) else w.dequantize()
        else:
            out[name] = t.float()
    return out
