"""Tensor parallelism without processes: shards put back together give the weights, the step message round-trips,
and the group placement refuses numbers that do not fit, naming the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.model.config import ModelConfig
from worker_svc.parallel import rank_group
from worker_svc.parallel.rank_group import StepInputs, placement
from worker_svc.parallel.sharding import Shard, local_config, shard_weights


def _config(heads: int = 8, kv: int = 4, vocab: int = 250) -> ModelConfig:
    return ModelConfig(architecture="qwen2", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=1,
                       num_heads=heads, num_kv_heads=kv, head_dim=4)


def _weights(c: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, h = c.head_dim, c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h),
              "model.norm.weight": (h,), "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (c.num_heads * d, h),
              "model.layers.0.self_attn.q_proj.bias": (c.num_heads * d,),
              "model.layers.0.self_attn.k_proj.weight": (c.num_kv_heads * d, h),
              "model.layers.0.self_attn.k_proj.bias": (c.num_kv_heads * d,),
              "model.layers.0.self_attn.v_proj.weight": (c.num_kv_heads * d, h),
              "model.layers.0.self_attn.o_proj.weight": (h, c.num_heads * d),
              "model.layers.0.mlp.gate_proj.weight": (c.intermediate_size, h),
              "model.layers.0.mlp.down_proj.weight": (h, c.intermediate_size)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("size", [2, 4])
def test_shards_concatenate_to_the_weights(size):
    c = _config()
    full = _weights(c)
    shards = [shard_weights(c, full, Shard(r, size)) for r in range(size)]
    local = local_config(c, size)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8 // size, 4 // size, 48 // size)
    for name, w in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            assert torch.equal(torch.cat(parts, dim=1), w), name
        elif "norm" in name:
            assert all(torch.equal(p, w) for p in parts), name
        else:
            joined = torch.cat(parts)
            assert torch.equal(joined[: len(w)], w), name
            assert not joined[len(w):].any(), f"{name}: the vocabulary padding must be zero rows"


def test_more_ranks_than_kv_heads_replicate_them():
    c = _config(heads=8, kv=2)
    full = _weights(c)
    k = "model.layers.0.self_attn.k_proj.weight"
    shards = [shard_weights(c, full, Shard(r, 4))[k] for r in range(4)]
    assert local_config(c, 4).num_kv_heads == 1
    # ranks 0, 1 hold KV head 0 (their q heads 0-3 use it), ranks 2, 3 KV head 1
    assert torch.equal(shards[0], full[k][:4]) and torch.equal(shards[1], full[k][:4])
    assert torch.equal(shards[2], full[k][4:]) and torch.equal(shards[3], full[k][4:])


def test_step_message_round_trip():
    a = np.arange
    step = StepInputs(a(2), a(2) + 5, a(7), a(7) + 1, np.array([3, 4]), np.array([10, 4]),
                      np.array([[1, 2, 3], [4, 0, 0]]), np.array([2, 6]))
    header, payload = step.pack()
    assert StepInputs.payload_len(header) == len(payload)
    back = StepInputs.unpack(header, payload)
    for field in ("copy_src", "copy_dst", "input_ids", "positions", "query_lens", "seq_lens", "block_tables",
                  "logits_indices"):
        assert np.array_equal(getattr(back, field), getattr(step, field)), field


def test_placement_refuses_numbers_that_do_not_fit(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"--nnodes 2 must divide --tensor-parallel-size 3"):
        placement(3, 2, 0, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match=r"--node-rank 2 must be in \[0, --nnodes 2\)"):
        placement(4, 2, 2, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match=r"--master-port is needed"):
        placement(4, 2, 1, "127.0.0.1", None)
    p = placement(4, 2, 1, "10.0.0.1", 29500)
    assert (p.rank, p.size, p.local_size, p.under_torchrun) == (2, 4, 2, False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not match the WORLD_SIZE 2"):
        placement(3, 1, 0, "127.0.0.1", None)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 1 does not match the WORLD_SIZE 2"):
        rank_group.start_group(1, 1, 0, "127.0.0.1", None, torch.device("cpu"), 5)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert rank_group.start_group(1, 1, 0, "127.0.0.1", None, torch.device("cpu"), 5) is None
