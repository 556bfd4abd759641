"""An EAGLE-3 head (`LlamaForCausalLMEagle3` checkpoints, as vLLM and SGLang load them): one Llama decoder layer
that drafts from the target's hidden states.

The checkpoint: config.json (`hidden_size`, heads, `intermediate_size`, `vocab_size` = the target's, `draft_vocab_size`,
`target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with `fc.weight`
[hidden, 3 * target_hidden] (the three auxiliary states to one), `midlayer.*` (the layer: `input_layernorm` on the
token embedding, `hidden_norm` on the hidden state, q/k/v projections over the two concatenated, so 2 * hidden wide),
`norm.weight`, `lm_head.weight` [draft_vocab, hidden], `d2t` (draft id -> target id offset) and optionally
`embed_tokens.weight` (otherwise the target's embedding is shared).

One row of the head's forward at position p reads the target's state at p and the token at p + 1, and predicts the
token at p + 2; its KV goes to position p of the head's own one-layer cache. Chaining feeds the layer's output
(before the final norm) back as the next row's hidden state.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from common.config import ConfigError
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.families.hf import hf_rope
from worker_svc.model.hidden_capture import HiddenCapture
from worker_svc.model.layers.linear import pack_linear_weight
from worker_svc.model.target_vocab import TargetVocab

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FLAG = "--speculative-config model"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the head's config names none: the inputs of layers 2, N / 2 and N - 3."""
    return (2, num_layers // 2, num_layers - 3)


def read_head(path: str, target: ModelConfig) -> tuple[ModelConfig, dict[str, torch.Tensor], tuple[int, ...]]:
    """The head's config, its tensors and the target layers it reads; ConfigError naming the field."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{FLAG} {path!r}: no config.json there (an EAGLE-3 head's directory)")
    with open(config_path) as f:
        cfg = json.load(f)
    arch = cfg.get("architectures") or []
    if not set(arch) & set(ARCHITECTURES):
        raise ConfigError(f"{path}/config.json field architectures={arch!r}: an EAGLE-3 head is one of "
                          f"{', '.join(ARCHITECTURES)}")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ConfigError(f"{FLAG} {path!r}: no *.safetensors files there")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{path}/config.json field num_hidden_layers={cfg['num_hidden_layers']}: an EAGLE-3 head "
                          "has one layer")
    target_hidden = cfg.get("target_hidden_size") or cfg["hidden_size"]
    if target_hidden != target.hidden_size or cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ConfigError(f"{path}/config.json fields target_hidden_size={target_hidden}, vocab_size="
                          f"{cfg.get('vocab_size')}: the target has hidden {target.hidden_size}, vocab "
                          f"{target.vocab_size}")
    eagle = cfg.get("eagle_config") or {}
    aux = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i <= target.num_layers for i in aux):
        raise ConfigError(f"{path}/config.json field eagle_config.eagle_aux_hidden_state_layer_ids={list(aux)}: "
                          f"three layer indexes in [0, {target.num_layers}] of the target")
    missing = [n for n in ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight")
               if n not in weights]
    if missing:
        raise ConfigError(f"{FLAG} {path!r}: the head's tensors lack {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    theta, scaling = hf_rope(cfg)
    config = ModelConfig(
        architecture="eagle3", vocab_size=int(cfg.get("draft_vocab_size") or target.vocab_size),
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_layers=1, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max(cfg.get("max_position_embeddings", 2048), target.max_position_embeddings))
    if weights["lm_head.weight"].shape[0] != config.vocab_size:
        raise ConfigError(f"{path}/config.json field draft_vocab_size={config.vocab_size}: lm_head.weight has "
                          f"{weights['lm_head.weight'].shape[0]} rows")
    return config, weights, aux


class Eagle3Head(LlamaModel):
    """The head's layer is LlamaModel's layer 0 with a wider attention input; the embedding is the target's."""

    reads_final = False  # it reads the target's auxiliary layers (`aux_layers`), not its final state

    def __init__(self, path: str, target: LlamaModel, target_config: ModelConfig, vocab: TargetVocab, **kw: Any):
        """target_config: the target's whole config (a tensor-parallel rank's model holds its local one)."""
        config, raw, self.aux_layers = read_head(path, target_config)
        own_embed = raw.get("embed_tokens.weight")
        weights = {("model.layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
                   for n, t in raw.items()}
        weights["model.norm.weight"] = weights.pop("norm.weight")
        # LlamaModel's constructor wants an embedding; the lookups go through `embed_ids`.
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"]
        super().__init__(config, weights, target.dtype, target.device, **kw)
        self.embed = None  # the lookups go through `embed_ids`
        self.fc = self.prepare_matrix(weights["fc.weight"])
        self.hidden_norm = weights["model.layers.0.hidden_norm.weight"].to(self.device, self.dtype)
        self.own_embed = None if own_embed is None else own_embed.to(self.device, self.dtype)
        self.vocab = vocab
        d2t = raw.get("d2t")
        self.draft_to_target = (None if d2t is None else
                                torch.arange(len(d2t), device=self.device) + d2t.to(self.device, torch.int64))

    def prepare_matrix(self, t: torch.Tensor) -> Any:
        t = t.to(self.device, self.dtype).contiguous()
        return pack_linear_weight(t) if self.prepacked else t

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.own_embed is not None:
            return self.own_embed[token_ids]
        return self.vocab.embed_tokens(token_ids)

    def first_hidden(self, capture: HiddenCapture, rows: torch.Tensor) -> torch.Tensor:
        """The target's three auxiliary states of `rows`, [rows, 3 * hidden] -> the head's hidden state."""
        return self.ops.linear(capture.aux_states(rows), self.fc)

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
             attn_meta: Any) -> torch.Tensor:
        """The layer over rows (token at p + 1, hidden state at p): its output before the final norm [rows, hidden]
        (`hidden` is updated in place)."""
        layer = self.layers[0]
        c, n = self.config, len(token_ids)
        x = torch.cat([self.ops.rms_norm(self.embed_ids(token_ids), layer.input_norm),
                       self.ops.rms_norm(hidden, self.hidden_norm)], dim=-1)
        q, k, v = self.ops.linear(x, layer.qkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk = torch.cat([q, k], dim=-1).view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = self.ops.rope(qk, self.rotaries[0].prepare(positions))
        o = self.paged_attention(0, qk, v.reshape(n, c.num_kv_heads, c.head_dim), kv_cache, attn_meta)
        return self.post_attention(0, layer, o, hidden)

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The greedy draft (target vocabulary ids) after each row's output."""
        draft = self.ops.linear(self.final_norm(h), self.lm_head).argmax(dim=-1)
        return draft if self.draft_to_target is None else self.draft_to_target[draft]
