"""Random-weight checkpoints for the speculative heads: a Llama target written by transformers with an EAGLE-3 head
beside it (the layout vLLM and SGLang load), and a Qwen3.5 target whose safetensors get `mtp.*` tensors added."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.support.random_weights import randomize

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 64, 4, 2, 16, 128, 512, 4
DRAFT_VOCAB = 256


def write_llama_target(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=VOCAB - 1)
    model = LlamaForCausalLM(cfg).eval()
    randomize(model)
    model.save_pretrained(path)
    return path


def _random(shape: tuple[int, ...], gen: torch.Generator, norm: bool = False) -> torch.Tensor:
    if norm:
        return 0.5 + torch.rand(shape, generator=gen)
    return 0.1 * torch.randn(shape, generator=gen)


def write_eagle3_head(path: str, aux_layers: list[int] | None = (0, 2, 4), dims: dict | None = None,
                      draft_vocab: int = DRAFT_VOCAB) -> str:
    """An EAGLE-3 head for a target of `dims` (hidden, heads, kv_heads, head_dim, intermediate, vocab; default
    write_llama_target's model): its draft vocabulary is the even target ids (d2t offsets). aux_layers None: the
    config names none (vLLM's default choice)."""
    d = dims or {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                 "intermediate": INTERMEDIATE, "vocab": VOCAB}
    hidden, inter = d["hidden"], d["intermediate"]
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    t = {"fc.weight": _random((hidden, 3 * hidden), gen), "norm.weight": _random((hidden,), gen, norm=True),
         "lm_head.weight": _random((draft_vocab, hidden), gen),
         "d2t": torch.arange(draft_vocab, dtype=torch.int64),  # draft id i -> target id 2 i
         "t2d": torch.arange(d["vocab"]) % 2 == 0}
    m = "midlayer."
    for name, shape in (("self_attn.q_proj", (q, 2 * hidden)), ("self_attn.k_proj", (kv, 2 * hidden)),
                        ("self_attn.v_proj", (kv, 2 * hidden)), ("self_attn.o_proj", (hidden, q)),
                        ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                        ("mlp.down_proj", (hidden, inter))):
        t[m + name + ".weight"] = _random(shape, gen)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[m + name + ".weight"] = _random((hidden,), gen, norm=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"],
           "intermediate_size": inter, "num_hidden_layers": 1, "vocab_size": d["vocab"],
           "draft_vocab_size": draft_vocab, "target_hidden_size": hidden, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 2048}
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def bundled_model_dims() -> dict:
    """The bundled SmolLM2-135M's shape, for an EAGLE-3 head beside it."""
    return {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "vocab": 49152}


def add_mtp_layer(path: str, num_layers_key: str = "mtp_num_hidden_layers") -> str:
    """Add `mtp.*` tensors (fc, the two pre-fc norms, one full-attention layer shaped like the target's, norm) to
    a saved Qwen3.5 / Qwen3-Next checkpoint at `path`, and the config key naming one MTP layer."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    attn = next(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    gen = torch.Generator().manual_seed(2)
    hidden = cfg["hidden_size"]
    prefix = f"model.layers.{attn}."
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            norm = "norm" in name
            tensors["mtp.layers.0." + name[len(prefix):]] = _random(tuple(t.shape), gen, norm=norm) - (1 if norm
                                                                                                      else 0)
    tensors["mtp.fc.weight"] = _random((hidden, 2 * hidden), gen)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.2 * torch.randn((hidden,), generator=gen)  # zero-centred: 1 + w
    save_file(tensors, file)
    cfg[num_layers_key] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path
