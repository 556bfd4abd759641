"""A Hugging Face checkpoint's `quantization_config`: checked at start (what llmserve does not apply is refused,
naming the field), and its FP8 tensors turned into the project's weights.

FP8 (vLLM's `fp8`, and compressed-tensors' `float-quantized`): `float8_e4m3fn` weights with a scale per block
(`weight_scale_inv`, `weight_block_size` [128, 128]), per tensor or per output channel (`weight_scale`). On CUDA they
stay FP8 (one byte a value, the scales beside) and are dequantized in each matmul (quant.QuantLinear): on CUDA by
torch into the activations' dtype, on the CPU into float32 registers by the project's kernel (`fp8_matmul`,
kernels/csrc/quant_matmul.cpp; float32 or bfloat16 activations). Where that kernel is not built (or --dtype is
another), and in the hybrid families, whose projections are dense, each projection is dequantized into --dtype as it
is loaded (two bytes a value in bfloat16), its codes freed before the next tensor is read (`runs_as_fp8`). The values
are the checkpoint's dequantized ones (rounded to the dtype where dequantized at load). Activations are not quantized
("dynamic" activation schemes are a kernel's choice; static scales are refused).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from worker_svc.model.hf_awq import check_awq
from worker_svc.model.hf_compressed_int import INT_FORMATS, check_int_weights
from worker_svc.model.hf_gptq import check_gptq
from worker_svc.model.quant import QuantizedWeight, fp8_kernel_takes

# --quantization's names (vLLM's) that an HF checkpoint can carry and llmserve applies.
HF_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")

# The matmul weights a dense family packs through quant.QuantLinear; any other FP8 tensor is dequantized at load.
_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def packed_by_the_model(name: str) -> bool:
    """Whether `name` is a matmul weight a dense family packs through quant.QuantLinear (else dequantized at load)."""
    return _PROJECTION.fullmatch(name) is not None


# mxfp4 (gpt-oss): the experts' `*_blocks` / `*_scales` are read as stored (worker_svc/model/mxfp4.py); the modules
# it does not convert are stored dense and read as such. transformers' `dequantize` is its own load-time choice.
_MXFP4_FIELDS = {"quant_method", "modules_to_not_convert", "dequantize"}
_FP8_FIELDS = {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert",
               "fmt"}


def _refuse(field: str, value, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r} is not applied by llmserve ({supported})")


def check_quantization_config(cfg: dict, requested: str | None) -> str | None:
    """The quantization method of a checkpoint's config.json (None: not quantized), after checking that every
    field is one llmserve applies and that `requested` (--quantization) agrees."""
    qc = cfg.get("quantization_config")
    if qc is None:
        if requested is not None:
            raise ValueError(f"--quantization {requested}: the checkpoint has no quantization_config (llmserve does "
                             "not quantize a model at load); drop --quantization")
        return None
    method = qc.get("quant_method")
    if method not in HF_METHODS:
        raise _refuse("quant_method", method, f"it applies {', '.join(HF_METHODS)}")
    if requested is not None and requested != method:
        raise ValueError(f"--quantization {requested} does not match the checkpoint's "
                         f"quantization_config.quant_method={method!r}")
    if method == "awq":
        check_awq(qc, _refuse)
    elif method == "gptq":
        check_gptq(qc, _refuse)
    elif method == "mxfp4":
        for key in qc:
            if key not in _MXFP4_FIELDS:
                raise _refuse(key, qc[key], f"mxfp4 fields it reads: {', '.join(sorted(_MXFP4_FIELDS))}")
    else:
        (_check_fp8 if method == "fp8" else _check_compressed_tensors)(qc)
    return method


def _check_fp8(qc: dict) -> None:
    for key in qc:
        if key not in _FP8_FIELDS:
            raise _refuse(key, qc[key], f"fp8 fields it reads: {', '.join(sorted(_FP8_FIELDS))}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", qc["activation_scheme"], "dynamic only: static input scales are not read")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", qc["fmt"], "e4m3 only")
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "two positive integers, or none")


def _check_compressed_tensors(qc: dict) -> None:
    fmt = qc.get("format")
    formats = ("float-quantized", *INT_FORMATS)
    if fmt not in formats:
        raise _refuse("format", fmt, f"compressed-tensors formats {', '.join(formats)}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(key, qc[key], "none only")
    for name, group in (qc.get("config_groups") or {}).items():
        where = f"config_groups.{name}"
        if group.get("format", fmt) != fmt:
            raise _refuse(f"{where}.format", group["format"], f"{fmt} only (the checkpoint's format)")
        if group.get("output_activations"):
            raise _refuse(f"{where}.output_activations", group["output_activations"], "none only")
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        if fmt in INT_FORMATS:
            check_int_weights(fmt, weights, acts, where, _refuse)
            continue
        for key, allowed in (("num_bits", (8,)), ("type", ("float",)), ("strategy", ("tensor", "channel", "block")),
                             ("symmetric", (True,)), ("dynamic", (False,)), ("actorder", (None,))):
            if weights.get(key) not in allowed:
                raise _refuse(f"{where}.weights.{key}", weights.get(key), f"one of {allowed}")
        if acts and not acts.get("dynamic"):
            raise _refuse(f"{where}.input_activations.dynamic", acts.get("dynamic"),
                          "true only: static input scales are not read")


def block_size(qc: dict) -> tuple[int, int]:
    """The [rows, columns] of a block-scaled FP8 weight's blocks: `weight_block_size` (fp8) or the config groups'
    `block_structure` (compressed-tensors); 128 x 128 where unnamed (DeepSeek-V3's and Qwen3-FP8's)."""
    block = qc.get("weight_block_size")
    for group in (qc.get("config_groups") or {}).values():
        block = block or (group.get("weights") or {}).get("block_structure")
    return tuple(block) if block else (128, 128)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, name: str,
               block: tuple[int, int] = (128, 128)) -> QuantizedWeight:
    """A float8_e4m3fn [out, in] weight and its scale (a scalar, one per output row, or one per `block`) as
    a QuantizedWeight whose `scale` is [out, ceil(in / group)]: rows repeated so q, k and v stack (cat_rows)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: an FP8 weight must be float8_e4m3fn; it is {weight.dtype}")
    out, inp = weight.shape
    scale = scale.float()
    if scale.numel() == 1 or (scale.dim() == 2 and scale.shape[1] == 1 and scale.shape[0] == out):
        return QuantizedWeight(weight, scale.reshape(-1, 1).expand(out, 1).contiguous(), None, 8, "fp8", group=inp)
    if scale.dim() != 2:
        raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} fits no FP8 layout for a {out}x{inp} weight")
    bn, bk = block
    if tuple(scale.shape) != (-(-out // bn), -(-inp // bk)):
        raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} does not fit {bn}x{bk} blocks of a "
                         f"{out}x{inp} weight")
    return QuantizedWeight(weight, scale.repeat_interleave(bn, dim=0)[:out].contiguous(), None, 8, "fp8", group=bk)


def runs_as_fp8(name: str, hybrid: bool, device: torch.device, weight: QuantizedWeight | None = None,
                dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the model runs weight `name` of an FP8 checkpoint as FP8 (quant.QuantLinear, dequantized in each
    matmul): a dense family's projection on an accelerator, or on the CPU where the project's FP8 kernel takes
    `weight` and `dtype` (float32, bfloat16). Every other FP8 weight is dequantized into --dtype as it is loaded: on
    a CPU without the kernel (torch has no FP8 matmul there, and dequantizing a whole matrix in every matmul made a
    layer 10-15x slower, experiments/fp8_matmul_cost.py), and in the hybrid families, whose projections are dense."""
    if hybrid or not packed_by_the_model(name):
        return False
    if device.type != "cpu":
        return True
    return weight is not None and dtype in (torch.float32, torch.bfloat16) and fp8_kernel_takes(weight)


def dequantize_fp8_in_place(weights: dict, dtype: torch.dtype) -> dict:
    """Every FP8 weight of `weights` dense in `dtype`, one at a time (each one's codes freed as it is replaced): for
    the compiled forward on the CPU (-O1..3), whose inductor graphs trace dense matmuls, not the FP8 kernel."""
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight) and w.is_fp8:
            weights[name] = w.dequantize(dtype)
    return weights


def convert_fp8(tensors: Mapping[str, torch.Tensor], block: tuple[int, int],
                put_fp8: Callable[[str, QuantizedWeight], Any],
                put: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
    """The model's weights from a checkpoint's tensors, one at a time in the checkpoint's order: every FP8 weight
    with its scale (`weight_scale_inv` or `weight_scale`, blocks of `block`) as a QuantizedWeight given to
    `put_fp8(name, weight)`, every other tensor to `put(name, tensor)`; what they return is kept. Each is read
    (`tensors` is lazy: safetensors_stream.LazyTensors) and placed before the next, so one source is held at once."""
    out: dict = {}
    for name in tensors:
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue
        if name.endswith(".input_scale"):
            raise ValueError(f"{name}: static activation scales are not read by llmserve")
        t = tensors[name]
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = tensors[name + "_scale_inv"] if name + "_scale_inv" in tensors else tensors.get(name + "_scale")
            if scale is None:
                raise ValueError(f"{name} is FP8 but the checkpoint has no {name}_scale_inv or {name}_scale")
            out[name] = put_fp8(name, fp8_weight(t, scale, name, block))
        else:
            out[name] = put(name, t)
        del t  # the source goes before the next tensor is read
    return out
