"""A checkpoint's own multi-token-prediction layer (Qwen3-Next, Qwen3.5), as vLLM runs it for method `mtp`.

The tensors sit in the target's safetensors under `mtp.`: `fc.weight` [hidden, 2 * hidden], the zero-centred norms
`pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm`, and `layers.0.*`, one full-attention decoder layer of the
family (its MoE feed-forward for Qwen3-Next); the embedding and lm_head are the target's. config.json counts the
layers: `mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers` (Qwen3-Next, DeepSeek-V3).

A row at position p: fc([norm_e(embed(token at p + 1)) ; norm_h(target's final normed state at p)]), the layer, the
final norm; its lm_head argmax is the draft for p + 2, and the normed output is the next chained row's hidden state.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from safetensors import safe_open

from common.config import ConfigError
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.hidden_capture import HiddenCapture
from worker_svc.model.layers.linear import pack_linear_weight
from worker_svc.model.target_vocab import TargetVocab

LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
FLAG = "--speculative-config method mtp"


def read_mtp_tensors(path: str) -> dict[str, torch.Tensor]:
    """The `mtp.*` tensors of the checkpoint directory `path`; ConfigError naming the field when it ships none."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{FLAG}: {path!r} is not a Hugging Face directory (a GGUF file carries no MTP layers)")
    with open(config_path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or cfg
    layers = next((text[k] for k in LAYER_KEYS if text.get(k)), 0)
    if not layers:
        raise ConfigError(f"{FLAG}: {path}/config.json has no MTP layers (field {' / '.join(LAYER_KEYS)} unset or "
                          "0); use a checkpoint that ships them, or another method")
    out: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith("mtp."):
                    out[name[len("mtp."):]] = f.get_tensor(name)
    need = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
    missing = [f"mtp.{n}" for n in need if n not in out] + ([] if any(n.startswith("layers.0.") for n in out)
                                                             else ["mtp.layers.0.*"])
    if missing:
        raise ConfigError(f"{FLAG}: {path}/config.json names {layers} MTP layer(s) but the safetensors lack "
                          f"{', '.join(missing)}")
    return out


class MtpHead:
    reads_final = True  # the target's final normed state
    aux_layers: tuple[int, ...] = ()

    def __init__(self, path: str, target: LlamaModel, target_config: ModelConfig, vocab: TargetVocab):
        """target_config: the target's whole config (a tensor-parallel rank's model holds its local one); vocab: its
        embedding and LM head (target_vocab.py)."""
        if not hasattr(target, "_attention") or not getattr(target, "hybrid", False):
            raise ConfigError(f"{FLAG}: the target {target.config.architecture} has no MTP layers llmserve runs "
                              "(Qwen3-Next and Qwen3.5 checkpoints ship them)")
        raw = read_mtp_tensors(path)
        c = target_config
        self.config = dataclasses.replace(c, num_layers=1, layer_types=["full_attention"],
                                          moe_layers=[0] if "layers.0.mlp.gate.weight" in raw else [])
        weights = {"model." + n: t for n, t in raw.items() if n.startswith("layers.0.")}
        weights["model.norm.weight"] = raw["norm.weight"]
        # The family's constructor wants an embedding and a head: the target's are shared (set below).
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"] = raw["fc.weight"][:1]
        self.layer = type(target)(self.config, weights, target.dtype, target.device, attention=target.attention,
                                  prepack=target.prepacked)
        self.layer.embed, self.layer.lm_head = None, vocab.lm_head  # lookups go through vocab.embed_tokens
        self.vocab = vocab
        fc = raw["fc.weight"].to(target.device, target.dtype).contiguous()
        self.fc = pack_linear_weight(fc) if target.prepacked else fc
        self.norm_embedding, self.norm_hidden = (1.0 + raw[f"pre_fc_norm_{x}.weight"].to(target.device, torch.float32)
                                                 for x in ("embedding", "hidden"))

    def first_hidden(self, capture: HiddenCapture, rows: torch.Tensor) -> torch.Tensor:
        return capture.last[rows]

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
             attn_meta: Any) -> torch.Tensor:
        ops = self.layer.ops
        x = torch.cat([ops.rms_norm(self.vocab.embed_tokens(token_ids), self.norm_embedding),
                       ops.rms_norm(hidden, self.norm_hidden)], dim=-1)
        h = self.layer._layers(ops.linear(x, self.fc), positions, kv_cache, attn_meta, None)
        return self.layer.final_norm(h)

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer.ops.linear(h, self.vocab.lm_head).argmax(dim=-1)
