"""Which projections of a model a LoRA adapter may target, per family: each PEFT module name's group in the pool
(q, k and v share the fused `qkv` group), its (in, out) features, the checkpoint path under a layer and the layers
that have it; and the modules refused with the reason (a hybrid's recurrent mixers, sparse MoE blocks).

Llama-shaped families: q/k/v/o under `self_attn` and gate/up/down under `mlp` in every layer. Hybrids only in the
layers of that kind: Qwen3.5 / Qwen3-Next's attention layers (q_proj twice as wide: per head the query, then its
output gate) and dense MLPs (not Qwen3-Next's sparse ones), Nemotron-H's attention and MLP blocks under `mixer`
(its MLP has no gate), Granite 4.0 hybrid's attention and shared MLP (`input_linear` is the fused [gate | up]).
The recurrent layers' projections (Gated DeltaNet, Mamba2) are refused: a delta on them would change the state that
the prefix cache's snapshots and the fork copies hold, and no family hooks them. Pure shape arithmetic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from worker_svc.core.kv_cache import ATTENTION_LAYER_TYPES
from worker_svc.model.config import ModelConfig
from worker_svc.parallel.hybrid_sharding import WHOLE, Cut, hybrid_cut, is_hybrid
from worker_svc.parallel.sharding import Shard, param_slice

QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
GROUP = {"o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "input_linear": "shared_in",
         "output_linear": "shared_out"}
DELTANET = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d")
MAMBA2 = ("in_proj", "out_proj", "conv1d")
# A layer's tensor name in a PEFT file: `...layers.<i>.<path>.<module>.lora_A|B[.default].weight`
KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.((?:\w+\.)*?)(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class Target:
    group: str  # the pool's group: qkv, o, gate, up, down, shared_in, shared_out
    index: int  # in the group (qkv: 0 q, 1 k, 2 v)
    fan_in: int
    fan_out: int
    path: str  # its parent under a layer in the checkpoint: self_attn, mlp, mixer, shared_mlp
    layers: tuple[int, ...]  # the layers that have it


@dataclass(frozen=True)
class LoraLayout:
    prefix: str  # the layers' checkpoint prefix: model.layers, backbone.layers
    targets: dict[str, Target]
    refused: dict[str, str]  # PEFT module name -> why it is not served

    def weight_name(self, layer: int, module: str) -> str:
        return f"{self.prefix}.{layer}.{self.targets[module].path}.{module}.weight"

    def groups(self) -> dict[str, tuple[tuple[int, ...], int, int, int]]:
        """Per pool group: (its layers, in features, out features, ranks per adapter: 3 for qkv, else 1)."""
        out = {}
        for t in self.targets.values():
            layers, fan_in, fan_out, ranks = out.get(t.group, (t.layers, t.fan_in, 0, 0))
            out[t.group] = (layers, fan_in, fan_out + t.fan_out if t.group == "qkv" else t.fan_out, ranks + 1)
        return out

    def qkv_offsets(self) -> tuple[int, ...]:
        """Where q's, k's and v's rows start in the fused qkv output."""
        q, k = (self.targets[m].fan_out if m in self.targets else 0 for m in ("q_proj", "k_proj"))
        return 0, q, q + k


def lora_layout(cfg: ModelConfig) -> LoraLayout:
    """The layout of `cfg` (a whole model's, or one tensor-parallel rank's local config: its widths)."""
    n, h, d = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    types = cfg.layer_types or ["full_attention"] * n
    attention = tuple(i for i, t in enumerate(types) if t in ATTENTION_LAYER_TYPES)
    everywhere = tuple(range(n))
    arch = cfg.architecture
    prefix, attn_path, mlp_path, refused = "model.layers", "self_attn", "mlp", {}
    mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    mlp_layers = everywhere
    if arch in ("qwen3_next", "qwen3_5"):
        q *= 2  # per head the query, then the sigmoid gate of the attention output
        mlp_layers = tuple(i for i in everywhere if i not in (cfg.moe_layers or ()))
        refused = dict.fromkeys(DELTANET, "a projection of the Gated DeltaNet layers (recurrent)")
        refused.update(dict.fromkeys(("shared_expert_gate", "experts"), "part of the sparse MoE blocks"))
    elif arch == "nemotron_h":
        prefix, attn_path, mlp_path = "backbone.layers", "mixer", "mixer"
        mlp = {"up_proj": (h, inter), "down_proj": (inter, h)}  # squared ReLU, no gate
        mlp_layers = tuple(i for i, t in enumerate(types) if t == "mlp")
        refused = dict.fromkeys(MAMBA2, "a projection of the Mamba2 layers (recurrent)")
    elif arch == "granitemoehybrid":
        shared = cfg.shared_expert_intermediate_size
        mlp_path, mlp = "shared_mlp", {"input_linear": (h, 2 * shared), "output_linear": (shared, h)}
        refused = dict.fromkeys(MAMBA2, "a projection of the Mamba2 layers (recurrent)")
        refused.update(dict.fromkeys(("router", "layer"), "part of the sparse MoE blocks"))
    targets = {m: Target("qkv", QKV[m], h, out, attn_path, attention)
               for m, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))}
    targets["o_proj"] = Target("o", 0, cfg.num_heads * d, h, attn_path, attention)
    targets.update({m: Target(GROUP[m], 0, i, o, mlp_path, mlp_layers) for m, (i, o) in mlp.items()})
    return LoraLayout(prefix, targets, refused)


def served(layout: LoraLayout) -> str:
    return ", ".join(layout.targets)


def check_tensor(layout: LoraLayout, layer: int, path: str, module: str) -> str | None:
    """Why layer `layer`'s `path`.`module` (a PEFT tensor's parts) cannot take an adapter; None when it can."""
    where = f"layer {layer} {path}{module}"
    if module in layout.refused:
        return f"{where} is {layout.refused[module]}; adapters are served on {served(layout)} only"
    t = layout.targets.get(module)
    if t is None:
        return f"{where} is not a supported module ({served(layout)})"
    if path.rstrip(".") != t.path:
        if ".experts." in f".{path}" or "shared_expert" in path or "block_sparse_moe" in path:
            return f"{where} is part of the sparse MoE blocks; adapters are served on {served(layout)} only"
        return f"{where} is not a supported module ({served(layout)} under {t.path})"
    if layer not in t.layers:
        return f"{where}: layer {layer} has no {module} (its {module} layers: {list(t.layers)})"
    return None


def lora_cut(name: str, cfg: ModelConfig, shard: Shard) -> Cut | None:
    """This rank's part of the base weight `name` ([out, in]) as a Cut (None: the whole tensor): B takes the same
    rows (dim 0), A the same columns (dim 1), so the rank's B @ A is its part of the delta."""
    if shard.size == 1:
        return None
    if is_hybrid(cfg) and (cut := hybrid_cut(name, cfg, shard.rank, shard.size)) is not None:
        return None if cut == WHOLE else cut
    s = param_slice(name, cfg, shard)
    return None if s is None else Cut(s[0], ((s[1], s[2]),))
