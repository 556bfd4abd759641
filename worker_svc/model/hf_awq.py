"""AWQ int4 checkpoints (AutoAWQ's GEMM layout) as the project's int4 weights (quant.QuantizedWeight, 32-groups).

AWQ stores, per linear layer, `qweight` int32 [in, out / 8] (eight 4-bit codes of neighbouring output columns per
int32, in the order 0 2 4 6 1 3 5 7), `qzeros` int32 [in / group, out / 8] packed the same way, and `scales`
float16 [in / group, out]; w = (q - zero) * scale. A group of 64 or 128 columns is two or four of the kernels'
32-groups with the same scale and offset, so the conversion is exact: scale * q + (-zero * scale).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from worker_svc.model.quant import GROUP, QuantizedWeight

AWQ_GROUPS = (32, 64, 128)
_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # the inverse of AWQ's packing order 0 2 4 6 1 3 5 7


def check_awq(qc: dict, refuse) -> None:
    """Refuse (`refuse(field, value, supported)` gives the error) what the conversion does not apply."""
    known = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
             "modules_to_not_convert"}
    for key in qc:
        if key not in known:
            raise refuse(key, qc[key], f"awq fields it reads: {', '.join(sorted(known))}")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse("bits", bits, "4 only")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in AWQ_GROUPS:
        raise refuse("group_size", group, f"one of {AWQ_GROUPS}")
    if qc.get("zero_point", True) is not True:
        raise refuse("zero_point", qc["zero_point"], "true only")
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise refuse("version", qc["version"], "gemm only")


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> uint8 codes [rows, cols] in 0..15, columns in their natural order."""
    shifts = torch.tensor([4 * n for n in _NIBBLE_OF_COLUMN], dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str) -> QuantizedWeight:
    """One layer's AWQ tensors as an int4 QuantizedWeight [out, in] with 32-groups."""
    codes = unpack_awq(qweight).T.contiguous()  # [out, in]
    out, inp = codes.shape
    groups = scales.shape[0]
    if inp % groups or (inp // groups) % GROUP:
        raise ValueError(f"{name}: {inp} input columns in {groups} AWQ groups is not a whole number of "
                         f"{GROUP}-column groups")
    repeat = inp // groups // GROUP
    scale = scales.float().T
    zero = -unpack_awq(qzeros).T.float() * scale
    return QuantizedWeight(codes, scale.repeat_interleave(repeat, 1).contiguous(),
                           zero.repeat_interleave(repeat, 1).contiguous(), 4, "awq")


def convert_awq(tensors: Mapping[str, torch.Tensor], keep_quantized: Callable[[str], bool],
                put_quantized: Callable[[str, QuantizedWeight], Any], put: Callable[[str, torch.Tensor], Any]) -> dict:
    """The model's weights from an AWQ checkpoint's tensors, one layer at a time in the checkpoint's order: each
    `qweight` / `qzeros` / `scales` triple becomes `<layer>.weight`, an int4 QuantizedWeight given to
    `put_quantized(name, weight)` where `keep_quantized(name)` (the model packs it), else dequantized in float32
    (MoE experts) and given to `put(name, tensor)` like every other tensor; what they return is kept, so a
    tensor-parallel rank's callbacks cut each to its shard before the next layer is read."""
    out: dict = {}
    for name in tensors:
        if name.endswith((".qzeros", ".scales")):
            continue
        t = tensors[name]
        if name.endswith(".qweight"):
            layer = name.removesuffix(".qweight")
            w = awq_weight(t, tensors[layer + ".qzeros"], tensors[layer + ".scales"], name)
            weight = layer + ".weight"
            out[weight] = put_quantized(weight, w) if keep_quantized(weight) else put(weight, w.dequantize())
            del w
        else:
            out[name] = put(name, t)
        del t  # the source goes before the next tensor is read
    return out
