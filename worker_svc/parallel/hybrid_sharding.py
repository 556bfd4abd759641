"""Tensor-parallel sharding of the hybrid families' own tensors (Gated DeltaNet, Mamba2, Qwen's gated queries):
which rows or columns of each weight a rank holds, as a list of ranges along one dim.

A recurrent layer is split by heads, as attention is: a rank holds some heads end to end, so its scan, its state
and its gated norm need nothing from the other ranks, and only the out-projection's partial products are summed.
Gated DeltaNet: key heads [r * Hk / n, ...) and the value heads grouped under them; its fused projections hold
q, k and v (and z, b, a) as separate row blocks, so a rank's rows are one range per block. Mamba2: heads and groups
together (each group's heads stay on the rank of its B and C), so the in-projection's z, x, B, C and dt blocks
and the conv's x, B, C channels are one range each. The state pool of a rank is then its shard of every slot.
Names and shapes are Hugging Face's ([out, in]); pure shape arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_svc.model.config import ModelConfig

RECURRENT = ("linear_attention", "mamba")
GATED_QUERY_FAMILIES = ("qwen3_next", "qwen3_5")  # q_proj rows: per head, the query then its gate
WHOLE = "whole"  # a tensor every rank holds in full


@dataclass(frozen=True)
class Cut:
    dim: int
    ranges: tuple[tuple[int, int], ...]


def is_hybrid(cfg: ModelConfig) -> bool:
    return any(t in RECURRENT for t in cfg.layer_types or ())


def check_hybrid_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming --tensor-parallel-size and the config.json field it does not divide."""
    counts = [("linear_num_key_heads", cfg.linear_num_key_heads), ("mamba_num_heads", cfg.mamba_num_heads),
              ("n_groups", cfg.mamba_n_groups),
              ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)]
    for field, n in counts:
        if n and n % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {field} {n}: the "
                             "recurrent layers are split by heads (and Mamba2's groups with them)")


def hybrid_cut(name: str, cfg: ModelConfig, rank: int, size: int) -> Cut | str | None:
    """This rank's part of a hybrid family's tensor `name`: a Cut, WHOLE, or None for a name the Llama rules cut
    (sharding.param_slice: k/v, o, the MLP, experts, the LM head)."""
    if name == "backbone.embeddings.weight":  # Nemotron-H's embedding: vocabulary-parallel like Llama's
        rows = -(-cfg.vocab_size // size)
        return Cut(0, ((rank * rows, min(cfg.vocab_size, (rank + 1) * rows)),))
    if ".linear_attn." in name:
        return _deltanet(name.split(".linear_attn.")[1], cfg, rank, size)
    if ".mixer." in name and cfg.mamba_num_heads and name.split(".mixer.")[1] not in _LLAMA_NAMED:
        return _mamba2(name.split(".mixer.")[1], cfg, rank, size)  # Nemotron-H's Mamba2 blocks
    if ".mamba." in name:  # Granite 4.0 hybrid
        return _mamba2(name.split(".mamba.")[1], cfg, rank, size)
    if cfg.architecture in GATED_QUERY_FAMILIES and name.endswith("self_attn.q_proj.weight"):
        n = cfg.num_heads // size
        return Cut(0, (_span(rank, n, 2 * cfg.head_dim),))
    if ".shared_expert." in name:  # Qwen3-Next's shared expert: an MLP of its own width
        n = cfg.shared_expert_intermediate_size // size
        return Cut(1 if "down_proj" in name else 0, (_span(rank, n, 1),))
    if name.endswith(("shared_mlp.input_linear.weight", "block_sparse_moe.input_linear.weight")):
        # Granite's fused [gate | up] rows ([E, 2I, hidden] for the experts): a rank's gate rows and its up rows
        width = cfg.shared_expert_intermediate_size if "shared_mlp" in name else cfg.moe_intermediate_size
        n = width // size
        return Cut(0 if "shared_mlp" in name else 1, (_span(rank, n, 1), _span(rank, n, 1, width)))
    if name.endswith(("shared_mlp.output_linear.weight", "block_sparse_moe.output_linear.weight")):
        width = cfg.shared_expert_intermediate_size if "shared_mlp" in name else cfg.moe_intermediate_size
        return Cut(1 if "shared_mlp" in name else 2, (_span(rank, width // size, 1),))
    return None


# Nemotron-H's attention and MLP blocks: Llama's names (and cuts) under `mixer.`
_LLAMA_NAMED = {f"{x}_proj.weight" for x in ("q", "k", "v", "o", "up", "down")}


def _span(rank: int, count: int, width: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s `count` units of `width` rows, after `offset` rows."""
    return offset + rank * count * width, offset + (rank + 1) * count * width


def _deltanet(part: str, cfg: ModelConfig, rank: int, size: int) -> Cut | str:
    kh, vh = cfg.linear_num_key_heads // size, cfg.linear_num_value_heads // size  # per rank
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_rows = cfg.linear_num_key_heads * dk
    qkv = (_span(rank, kh, dk), _span(rank, kh, dk, key_rows), _span(rank, vh, dv, 2 * key_rows))
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    if part in ("in_proj_qkv.weight", "conv1d.weight", "conv1d.bias"):
        return Cut(0, qkv)
    if part == "in_proj_qkvz.weight":  # grouped per key head: a rank's key heads are one run of rows
        return Cut(0, (_span(rank, kh, 2 * dk + 2 * r * dv),))
    if part == "in_proj_ba.weight":
        return Cut(0, (_span(rank, kh, 2 * r),))
    if part == "in_proj_z.weight":
        return Cut(0, (_span(rank, vh, dv),))
    if part in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        return Cut(0, (_span(rank, vh, 1),))
    if part == "out_proj.weight":
        return Cut(1, (_span(rank, vh, dv),))
    return WHOLE  # norm.weight: one weight of a value head's width, shared by all heads


def _mamba2(part: str, cfg: ModelConfig, rank: int, size: int) -> Cut | str:
    h, g = cfg.mamba_num_heads // size, cfg.mamba_n_groups // size  # per rank
    p, n = cfg.mamba_head_dim, cfg.ssm_state_size
    inner, gn = cfg.mamba_num_heads * p, cfg.mamba_n_groups * n
    xbc = (_span(rank, h, p), _span(rank, g, n, inner), _span(rank, g, n, inner + gn))
    if part == "in_proj.weight":  # [z | x B C | dt]
        z = _span(rank, h, p)
        x, b, c = ((a + inner, e + inner) for a, e in xbc)
        return Cut(0, (z, x, b, c, _span(rank, h, 1, 2 * inner + 2 * gn)))
    if part in ("conv1d.weight", "conv1d.bias"):
        return Cut(0, xbc)
    if part in ("dt_bias", "A_log", "D"):
        return Cut(0, (_span(rank, h, 1),))
    if part == "norm.weight":  # per inner channel, normed per group: a rank's groups are its channels
        return Cut(0, (_span(rank, h, p),))
    if part == "out_proj.weight":
        return Cut(1, (_span(rank, h, p),))
    return WHOLE
