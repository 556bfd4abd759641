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


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                offset: int, name: str) -> QuantizedWeight | torch.Tensor:
    """One layer's GPTQ tensors as an int4 QuantizedWeight [out, in] with 32-groups, exactly; or, where a
    32-column run spans two groups (act-order), the float32 dequantized weight."""
    codes = unpack_rows(qweight)  # [in, out]
    inp, out = codes.shape
    zeros = unpack_columns(qzeros)[:, :out].float() + offset  # [groups, out]
    scales = scales.float()
    groups = scales.shape[0]
    if g_idx is None:
        if inp % groups:
            raise ValueError(f"{name}: {inp} input columns do not split into {groups} GPTQ groups")
        g_idx = torch.arange(inp) // (inp // groups)
    g_idx = g_idx.long()
    if g_idx.shape != (inp,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{name}: g_idx of shape {tuple(g_idx.shape)} does not give each of {inp} input columns "
                         f"one of {groups} groups")
    runs = g_idx.view(-1, GROUP) if inp % GROUP == 0 else None
    if runs is None or not bool((runs == runs[:, :1]).all()):
        return ((codes.float() - zeros[g_idx]) * scales[g_idx]).T.contiguous()
    first = runs[:, 0]
    scale = scales[first].T.contiguous()  # [out, in / 32]
    return QuantizedWeight(codes.T.contiguous(), scale, (-zeros[first].T * scale).contiguous(), 4, "gptq")


def convert_gptq(tensors: Mapping[str, torch.Tensor], qc: dict, keep_quantized,
                 place: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float) -> dict:
    """The model's weights from a GPTQ checkpoint's tensors: each `qweight` / `qzeros` / `scales` (/ `g_idx`)
    becomes `<layer>.weight`, an int4 QuantizedWeight where `keep_quantized(name)` (the model packs it), else
    float32 dequantized (MoE experts); the rest float32. If any layer cannot be exact int4 (act-order), all are
    dequantized: the model fuses q/k/v and gate/up, which must be of one form."""
    offset = zero_offset(qc)
    out: dict = {}
    for name in tensors:
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        t = tensors[name]
        if name.endswith(".qweight"):
            layer = name.removesuffix(".qweight")
            w = gptq_weight(t, tensors[layer + ".qzeros"], tensors[layer + ".scales"], tensors.get(layer + ".g_idx"),
                            offset, name)
            keep = isinstance(w, QuantizedWeight) and keep_quantized(layer + ".weight")
            out[layer + ".weight"] = w if keep else place(w.dequantize() if isinstance(w, QuantizedWeight) else w)
        else:
            out[name] = place(t)
    if any(isinstance(t, torch.Tensor) and n.endswith(".weight") and n.removesuffix(".weight") + ".qweight"
           in tensors for n, t in out.items()):
        out = {n: place(t.dequantize()) if isinstance(t, QuantizedWeight) else t for n, t in out.items()}
    return out
