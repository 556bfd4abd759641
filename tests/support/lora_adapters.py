"""Random PEFT LoRA adapters written in the PEFT layout (adapter_config.json + adapter_model.safetensors), and the
Hugging Face model with one merged into its weights (the oracle: W + scale * B @ A)."""

from __future__ import annotations

import copy
import json
import math
import os

import torch
from safetensors.torch import save_file

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ATTN + ("gate_proj", "up_proj", "down_proj")


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of a transformers Llama config."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, i = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(path: str, cfg, *, rank: int, alpha: float, modules=ALL, seed: int = 0, rslora: bool = False,
                  std_b: float = 0.05, layers=None) -> str:
    """A random adapter for every layer (or `layers`) and module of `modules`; returns `path`."""
    targets = {f"model.layers.{layer}.{'self_attn' if m in ATTN else 'mlp'}.{m}": shapes(cfg)[m]
               for layer in (range(cfg.num_hidden_layers) if layers is None else layers) for m in modules}
    return write_modules(path, targets, modules, rank=rank, alpha=alpha, seed=seed, rslora=rslora, std_b=std_b)


def linear_modules(hf_model, modules, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """What PEFT's `target_modules` list picks in `hf_model`: every nn.Linear whose name ends in one of `modules`
    (and holds none of `skip`), by its module path, with its (in, out) features."""
    return {name: (m.in_features, m.out_features) for name, m in hf_model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules
            and not any(s in name for s in skip)}


def write_modules(path: str, targets: dict[str, tuple[int, int]], modules, *, rank: int, alpha: float,
                  seed: int = 0, rslora: bool = False, std_b: float = 0.05) -> str:
    """A random adapter in the PEFT layout on `targets` (module path -> (in, out)), naming `modules` as its
    target_modules; returns `path`."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in targets.items():
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
        tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std_b
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
            "use_rslora": rslora, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "base"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(meta, f)
    return path


def merged(hf_model, path: str):
    """A copy of `hf_model` with the adapter at `path` merged into its projection weights."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        meta = json.load(f)
    r, alpha = meta["r"], meta["lora_alpha"]
    scale = alpha / math.sqrt(r) if meta.get("use_rslora") else alpha / r
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            w = params[name]
            w += (scale * (b.double() @ a.double())).to(w.dtype)
    return model.eval()
