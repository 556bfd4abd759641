"""GPTQ int4 checkpoints (AutoGPTQ / GPTQModel / optimum) as the project's int4 weights (quant.QuantizedWeight).

GPTQ stores, per linear layer, `qweight` int32 [in / 8, out] (eight 4-bit codes of neighbouring input rows per
int32, nibble i holding row 8k + i), `qzeros` int32 [groups, out / 8] (packed the same way along the output dim),
`scales` float16 [groups, out] and `g_idx` int32 [in] (the group of each input column); w = (q - zero) * scale
with the zero and scale of the column's group. The original format (`checkpoint_format: gptq`) stores each zero
minus one (so a symmetric 4-bit zero of 8 is stored as 7); `gptq_v2` stores the zero itself.

Without act-order the groups are runs of 32, 64 or 128 columns: two or four of the kernels' 32-groups with one
scale and offset, converted exactly (scale * q + (-zero * scale)). With act-order (`desc_act: true`) `g_idx` is a
permutation of that: where every 32-column run still falls in one group the conversion stays exact; otherwise the
layer would need its input permuted inside the matmul, which the int4 kernels do not do, so such a checkpoint's
GPTQ layers are dequantized at load (float32, cast to --dtype by the model) and run as dense matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from worker_svc.model.quant import GROUP, QuantizedWeight

GPTQ_GROUPS = (32, 64, 128, -1)  # -1: one group per row (per output channel)

# Fields that describe how the checkpoint was made (calibration, kernels of other engines), not its values.
_INFORMATIONAL = {"quant_method", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
                  "model_name_or_path", "model_file_base_name", "dataset", "tokenizer", "use_exllama",
                  "exllama_config", "use_cuda_fp16", "cache_block_outputs", "batch_size", "pad_token_id",
                  "max_input_length", "modules_in_block_to_quantize", "module_name_preceding_first_quantized_layer",
                  "block_name_to_quantize", "meta", "backend", "modules_to_not_convert", "quantizer", "mse",
                  "v2", "v2_alpha"}
_READ = {"bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "lm_head", "pack_dtype"}


def check_gptq(qc: dict, refuse) -> None:
    """Refuse (`refuse(field, value, supported)` gives the error) what the conversion does not apply."""
    known = _INFORMATIONAL | _READ
    for key in qc:
        if key not in known:
            raise refuse(key, qc[key], f"gptq fields it reads: {', '.join(sorted(_READ))}")
    if qc.get("bits") != 4:
        raise refuse("bits", qc.get("bits"), "4 only")
    if qc.get("group_size", 128) not in GPTQ_GROUPS:
        raise refuse("group_size", qc["group_size"], f"one of {GPTQ_GROUPS}")
    for key in ("checkpoint_format", "format"):
        if qc.get(key, "gptq") not in ("gptq", "gptq_v2"):
            raise refuse(key, qc[key], "gptq or gptq_v2")
    if qc.get("lm_head", False):
        raise refuse("lm_head", qc["lm_head"], "false only: a quantized lm_head is not read")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise refuse("pack_dtype", qc["pack_dtype"], "int32 only")


def zero_offset(qc: dict) -> int:
    """What to add to a stored zero: 1 in the original format (zeros stored minus one), 0 in gptq_v2."""
    return 0 if "gptq_v2" in (qc.get("checkpoint_format"), qc.get("format")) else 1


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows / 8, cols] -> uint8 codes [rows, cols]: nibble i of row k is row 8k + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> uint8 codes [rows, cols]: nibble i of column k is column 8k + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)


def _groups_of_columns(g_idx: torch.Tensor | None, inp: int, groups: int, name: str) -> torch.Tensor:
    """The group of each of `inp` input columns: `g_idx` checked, or (without one) runs of inp / groups."""
    if g_idx is None:
        if inp % groups:
            raise ValueError(f"{name}: {inp} input columns do not split into {groups} GPTQ groups")
        return torch.arange(inp) // (inp // groups)
    g_idx = g_idx.long()
    if g_idx.shape != (inp,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{name}: g_idx of shape {tuple(g_idx.shape)} does not give each of {inp} input columns "
                         f"one of {groups} groups")
    return g_idx


def _runs_keep_one_group(g_idx: torch.Tensor) -> bool:
    """Whether every 32-column run of the input falls in one group (the int4 kernels' groups hold it exactly)."""
    return g_idx.numel() % GROUP == 0 and bool((g_idx.view(-1, GROUP) == g_idx.view(-1, GROUP)[:, :1]).all())


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                offset: int, name: str) -> QuantizedWeight | torch.Tensor:
    """One layer's GPTQ tensors as an int4 QuantizedWeight [out, in] with 32-groups, exactly; or, where a
    32-column run spans two groups (act-order), the float32 dequantized weight."""
    codes = unpack_rows(qweight)  # [in, out]
    inp, out = codes.shape
    zeros = unpack_columns(qzeros)[:, :out].float() + offset  # [groups, out]
    scales = scales.float()
    g_idx = _groups_of_columns(g_idx, inp, scales.shape[0], name)
    if not _runs_keep_one_group(g_idx):
        return ((codes.float() - zeros[g_idx]) * scales[g_idx]).T.contiguous()
    first = g_idx.view(-1, GROUP)[:, 0]
    scale = scales[first].T.contiguous()  # [out, in / 32]
    return QuantizedWeight(codes.T.contiguous(), scale, (-zeros[first].T * scale).contiguous(), 4, "gptq")


def _every_layer_int4(tensors: Mapping[str, torch.Tensor], layers: list[str], keep_quantized) -> bool:
    """Whether every GPTQ layer is kept int4: packed by the model and exact (no 32-column run mixing groups). Read
    before converting, from the `g_idx` vectors and the shapes alone, so each layer is placed in its final form as it
    is converted (a rank's shard of it, never the whole model first)."""
    if not all(keep_quantized(layer + ".weight") for layer in layers):
        return False
    for layer in layers:
        if layer + ".g_idx" in tensors:
            if not _runs_keep_one_group(tensors[layer + ".g_idx"].long()):
                return False
            continue
        inp, groups = 8 * _shape(tensors, layer + ".qweight")[0], _shape(tensors, layer + ".scales")[0]
        if not _runs_keep_one_group(_groups_of_columns(None, inp, groups, layer + ".qweight")):
            return False
    return True


def _shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A stored tensor's shape, without reading it where `tensors` can tell (safetensors_stream.LazyTensors)."""
    shape_of = getattr(tensors, "shape", None)
    return tuple(shape_of(name)) if shape_of is not None else tuple(tensors[name].shape)


def convert_gptq(tensors: Mapping[str, torch.Tensor], qc: dict, keep_quantized: Callable[[str], bool],
                 put_quantized: Callable[[str, QuantizedWeight], Any],
                 put: Callable[[str, torch.Tensor], Any]) -> dict:
    """The model's weights from a GPTQ checkpoint's tensors, one layer at a time in the checkpoint's order: each
    `qweight` / `qzeros` / `scales` (/ `g_idx`) becomes `<layer>.weight`, an int4 QuantizedWeight given to
    `put_quantized(name, weight)`, or float32 dequantized and given to `put(name, tensor)` like every other tensor;
    what they return is kept. The layers stay int4 only if all do (`keep_quantized(name)` for each, and none mixes
    groups in a 32-column run, act-order): the model fuses q/k/v and gate/up, which must be of one form."""
    offset = zero_offset(qc)
    layers = [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]
    int4 = _every_layer_int4(tensors, layers, keep_quantized)
    out: dict = {}
    for name in tensors:
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        t = tensors[name]
        if name.endswith(".qweight"):
            layer = name.removesuffix(".qweight")
            w = gptq_weight(t, tensors[layer + ".qzeros"], tensors[layer + ".scales"], tensors.get(layer + ".g_idx"),
                            offset, name)
            weight = layer + ".weight"
            if int4:
                out[weight] = put_quantized(weight, w)
            else:
                out[weight] = put(weight, w.dequantize() if isinstance(w, QuantizedWeight) else w)
            del w
        else:
            out[name] = put(name, t)
        del t  # the source goes before the next tensor is read
    return out
