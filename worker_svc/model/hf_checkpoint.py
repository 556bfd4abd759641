"""Load a Hugging Face checkpoint directory (config.json, *.safetensors, optional generation_config.json): the
model's config and its weights keyed by HF parameter names, in the placement's dtype and device.

Every tensor is read, converted once and placed before the next is read (safetensors_stream.py), so the host holds
the weights being kept plus one tensor in flight. A quantized checkpoint's tensors are read as stored (hf_quant.py,
hf_awq.py, hf_gptq.py, hf_compressed_int.py) and each layer is converted, cut to this rank's shard and placed before
the next is read: an int4 / int8 projection the model packs is cut as stored (quant_sharding.py), any other
(the hybrid families', MoE experts', GPTQ act-order's) dequantized in float32, cut as a dense tensor and cast to
--dtype; an FP8 projection the model will not run as FP8 (a hybrid family's, or any on a CPU without the project's
FP8 kernel) is cut and dequantized into --dtype as it arrives. A tensor-parallel rank so never holds the whole
model's converted weights.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from worker_svc.model import families as models
from worker_svc.model import hf_awq, hf_compressed_int, hf_gptq, hf_quant
from worker_svc.model.config import ModelConfig
from worker_svc.model.families.hf import ROPE_TYPES, hf_rope
from worker_svc.model.quant import QuantizedWeight
from worker_svc.model.safetensors_stream import HOST_FLOAT32, LazyTensors, Placement, iter_tensors, place, tensor_names
from worker_svc.parallel.quant_sharding import shard_quantized
from worker_svc.parallel.sharding import FULL, Shard, check_shardable, shard_tensor


def model_name(path: str) -> str:
    """The model's default served name: the file or directory name it was given (as vLLM names a model after
    its path), not a GGUF's `general.name` title."""
    return os.path.basename(os.path.normpath(path))


def load_hf_dir(path: str, shard: Shard = FULL,
                quantization: str | None = None,
                placement: Placement = HOST_FLOAT32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load an HF checkpoint directory: config.json, *.safetensors, optional generation_config.json. Tensors are
    read one at a time, each converted once and placed before the next (safetensors_stream.iter_tensors); a
    tensor-parallel rank reads only its slices from the files. A quantization_config is checked against
    `quantization` (--quantization) and applied, or refused (hf_quant.py)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    try:
        family = models.model_class(cfg.get("architectures") or [])
        rope_theta, rope_scaling = hf_rope(cfg, getattr(family, "rope_types", ROPE_TYPES))  # YaRN: gpt-oss only
        extra = family.hf_config(cfg)
        quant_method = hf_quant.check_quantization_config(cfg, quantization)
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}") from None

    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos_ids = _as_id_list(cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos_ids += [i for i in _as_id_list(json.load(f).get("eos_token_id")) if i not in eos_ids]

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names = {name for _, name in tensor_names(files)}

    config = ModelConfig(**{**dict(
        architecture=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg.get("num_hidden_layers", 0),  # a family may count its layers otherwise (Nemotron-H)
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        # The head is tied when the checkpoint has no lm_head (save_pretrained drops tied copies).
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in names,
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        name=model_name(path),
    ), **extra})
    check_shardable(config, shard.size)
    if shard.size > 1 and not getattr(family, "tensor_parallel", True):
        raise ValueError(f"--tensor-parallel-size {shard.size}: {family.name} is not sharded yet; run it with "
                         "--tensor-parallel-size 1")
    if quant_method == "mxfp4":  # packed experts read as stored, the rest as any checkpoint (the family reads them)
        if not getattr(family, "reads_mxfp4", False):
            raise ValueError(f"{path}/config.json: quantization_config.quant_method='mxfp4' is applied to gpt-oss's "
                             f"experts only, not to {family.name}")
        return config, dict(iter_tensors(files, config, shard, placement))
    if quant_method is not None:
        return config, _load_hf_quantized(files, cfg["quantization_config"], config, shard,
                                          getattr(family, "hybrid", False), placement)
    return config, dict(iter_tensors(files, config, shard, placement))


def _load_hf_quantized(files: list[str], qc: dict, config: ModelConfig, shard: Shard, hybrid: bool,
                       placement: Placement) -> dict:
    """The weights of a quantized checkpoint (its quantization_config `qc`, checked), its tensors read as stored,
    converted and cut to this rank's `shard` one layer at a time (quantized ones with their scales,
    quant_sharding.py), so a rank never holds the whole model's converted weights."""
    # Read lazily: a layer's codes, scales and zeros are read when its conversion needs them, then let go. The
    # dense tensors go straight to --dtype on the host (no float32 copy of each kept): the model moves them.
    tensors, host = LazyTensors(files), Placement(placement.dtype)
    if qc["quant_method"] in ("fp8", "compressed-tensors") and qc.get("format") not in hf_compressed_int.INT_FORMATS:
        return _fp8_weights(tensors, hf_quant.block_size(qc), config, shard, hybrid, placement)
    # The hybrid families run their projections as dense matmuls (not quant.QuantLinear): dequantized at load.
    keep = (lambda name: False) if hybrid else hf_quant.packed_by_the_model

    def put_quantized(name: str, w: QuantizedWeight) -> QuantizedWeight:
        return shard_quantized(name, w, config, shard)  # whole groups only, else refused naming the limit

    def put(name: str, t: torch.Tensor) -> torch.Tensor:  # a stored tensor, or a projection dequantized in float32
        return place(shard_tensor(name, t, config, shard), host)  # cut first: only the rank's part is cast

    if qc["quant_method"] == "gptq":
        return hf_gptq.convert_gptq(tensors, qc, keep, put_quantized, put)
    if qc["quant_method"] == "awq":
        return hf_awq.convert_awq(tensors, keep, put_quantized, put)
    convert = hf_compressed_int.convert_pack_quantized if qc["format"] == "pack-quantized" else \
        hf_compressed_int.convert_int_quantized
    return convert(tensors, keep, put_quantized, put)


def _fp8_weights(tensors: LazyTensors, block: tuple[int, int], config: ModelConfig, shard: Shard, hybrid: bool,
                 placement: Placement) -> dict:
    """An FP8 checkpoint's weights, each cut to this rank's shard and placed as it is read: a projection the model
    runs as FP8 (hf_quant.runs_as_fp8) stays FP8, any other is dequantized into --dtype now (its codes and
    scales are freed before the next tensor is read); the dense tensors go to --dtype."""
    host = Placement(placement.dtype)

    def put_fp8(name: str, w: QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        dtype = host.dtype_of(torch.float32, w.codes.dim())
        if hybrid or not hf_quant.packed_by_the_model(name):  # dense on every device: cut as a dense tensor
            dense = w.dequantize(dtype)
            return dense if shard.size == 1 else place(shard_tensor(name, dense, config, shard), host)
        if shard.size > 1:  # a dense family's projection is cut as stored, so a cut through a block is refused alike
            w = shard_quantized(name, w, config, shard)  # on every device
        return w if hf_quant.runs_as_fp8(name, hybrid, placement.device, w, dtype) else w.dequantize(dtype)

    return hf_quant.convert_fp8(tensors, block, put_fp8,
                                lambda name, t: place(shard_tensor(name, t, config, shard), host))


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
