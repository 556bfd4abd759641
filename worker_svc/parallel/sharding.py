"""Megatron-style tensor-parallel sharding of a Llama-family checkpoint: which slice of each weight a rank holds.

q/k/v and gate/up are column-parallel (a rank holds some output rows), o and down row-parallel (some input
columns; their partial outputs are summed by one all-reduce); each expert of a sparse MoE block is split like the
MLP (its gate/up rows, its down columns; the router is replicated). The embedding and the LM head are
vocabulary-parallel (a rank holds a contiguous range of token rows, padded with zero rows so that every rank
holds as many), norms replicated. KV heads are split across ranks; with more ranks than KV heads each KV head is
replicated on `size // num_kv_heads` consecutive ranks, so that every rank's query heads still share its one KV head.
Names and shapes are Hugging Face's ([out, in]); pure shape arithmetic, no collectives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers.moe import expert_slice
from worker_svc.parallel.hybrid_sharding import WHOLE, check_hybrid_shardable, hybrid_cut, is_hybrid


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int


FULL = Shard(0, 1)
VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight", "backbone.embeddings.weight")


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming --tensor-parallel-size and the count that it does not divide."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {cfg.num_heads} attention "
                         f"heads (num_attention_heads)")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {cfg.num_kv_heads} KV heads "
                         f"(num_key_value_heads): one must divide the other")
    if cfg.intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}")
    if cfg.num_experts:
        expert_slice(cfg.moe_intermediate_size, 0, size)
    if is_hybrid(cfg):
        check_hybrid_shardable(cfg, size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model computes with: its heads and MLP width (vocab_size stays the whole model's)."""
    if size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                               intermediate_size=cfg.intermediate_size // size,
                               moe_intermediate_size=cfg.moe_intermediate_size // size,
                               # hybrid models (hybrid_sharding.py): a rank's recurrent heads and groups
                               linear_num_key_heads=cfg.linear_num_key_heads // size,
                               linear_num_value_heads=cfg.linear_num_value_heads // size,
                               mamba_num_heads=cfg.mamba_num_heads // size, mamba_n_groups=cfg.mamba_n_groups // size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)


def vocab_rows(cfg: ModelConfig, size: int) -> int:
    """Embedding / LM head rows per rank: the vocabulary split evenly, rounded up."""
    return -(-cfg.vocab_size // size)


def _kv_heads(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first KV head, count) of this rank."""
    if shard.size <= cfg.num_kv_heads:
        n = cfg.num_kv_heads // shard.size
        return shard.rank * n, n
    return shard.rank * cfg.num_kv_heads // shard.size, 1  # replicated on size // num_kv_heads ranks


def param_slice(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of `name` that this rank holds, or None when it holds the whole tensor."""
    if shard.size == 1:
        return None
    d = cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = vocab_rows(cfg, shard.size)
        return 0, shard.rank * rows, min(cfg.vocab_size, (shard.rank + 1) * rows)
    kind = name.rsplit(".", 2)[-2]  # q_proj, k_proj, ..., input_layernorm
    is_bias = name.endswith(".bias")
    if kind == "q_proj":
        n = cfg.num_heads // shard.size
        return 0, shard.rank * n * d, (shard.rank + 1) * n * d
    if kind in ("k_proj", "v_proj"):
        first, n = _kv_heads(cfg, shard)
        return 0, first * d, (first + n) * d
    if kind == "o_proj":
        if is_bias:
            return None  # added once, after the all-reduce (by rank 0)
        n = cfg.num_heads // shard.size
        return 1, shard.rank * n * d, (shard.rank + 1) * n * d
    if ".experts." in name:  # one expert of a sparse block (layers/moe.py): its rows of gate / up, columns of down
        start, stop = expert_slice(cfg.moe_intermediate_size, shard.rank, shard.size)
        return (1 if kind in ("w2", "down_proj") else 0), start, stop
    if kind in ("gate_proj", "up_proj", "down_proj"):
        n = cfg.intermediate_size // shard.size
        if kind == "down_proj":
            return (None if is_bias else (1, shard.rank * n, (shard.rank + 1) * n))
        return 0, shard.rank * n, (shard.rank + 1) * n
    return None  # norms


def shard_tensor(name: str, tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """This rank's part of `tensor`: a torch tensor, or a safetensors slice (`safe_open(...).get_slice`), which
    reads only those bytes. Vocabulary shards are padded with zero rows to `vocab_rows`."""
    if shard.size > 1 and is_hybrid(cfg) and (cut := hybrid_cut(name, cfg, shard.rank, shard.size)) is not None:
        if cut == WHOLE:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        lead = (slice(None),) * cut.dim
        parts = [tensor[(*lead, slice(a, b))] for a, b in cut.ranges]
        part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.dim)
        return pad_vocab_rows(name, part, cfg, shard).contiguous()
    s = param_slice(name, cfg, shard)
    if s is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    dim, start, stop = s
    part = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
    return pad_vocab_rows(name, part, cfg, shard).contiguous()


def pad_vocab_rows(name: str, part: torch.Tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """A vocabulary shard with zero rows added up to `vocab_rows` (the last rank's, when the vocabulary does not
    divide); any other tensor as it is."""
    if shard.size == 1 or name not in VOCAB_NAMES:
        return part
    missing = vocab_rows(cfg, shard.size) - part.shape[0]
    return torch.cat([part, part.new_zeros(missing, *part.shape[1:])]) if missing else part


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """Every weight cut to this rank's part (for weights already in memory, e.g. dequantized GGUF)."""
    return {name: shard_tensor(name, t, cfg, shard) for name, t in weights.items()}
