"""Tensor-parallel model math: N gloo ranks on this CPU give the logits of one rank.

Random-weight Llama (8 query heads, 2 KV heads) and Qwen2 (q/k/v biases, tied head) checkpoints are saved
as safetensors, each rank loads only its slices, and the group runs a chunked prefill then a mixed
prefill+decode step over its shard of a paged KV pool; rank 0's gathered logits must match the unsharded model's
within 1e-4 in float32 (the compiled forward at N = 2 too; the Triton kernels, in the interpreter, within 1e-3).
N = 4 exceeds the 2 KV heads (each is replicated on two ranks); the vocabulary (250) does not divide by 4 (padded
shards). Four rank processes in all: each size runs on a subgroup of one world.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

import kernels
from llmserve.processes import free_port
from tests.support.random_weights import randomize
from worker_svc.config import CompilationConfig
from worker_svc.model.compiled import CompiledForward
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import Shard, check_shardable, local_config

BLOCK_SIZE = 4
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    import transformers  # here, not at the top: every spawned rank imports this module

    common = dict(vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    paths = []
    for name, model in (("llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(
                            **common, tie_word_embeddings=False))),
                        ("qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
                            **common, tie_word_embeddings=True)))):
        path = str(tmp_path_factory.mktemp(name))
        randomize(model)
        model.eval().save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths


def _steps(model: LlamaModel) -> list[torch.Tensor]:
    """Logits of every row of: prefill chunks of two sequences, then one decode row plus a second chunk."""
    kv = torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=gen)
    tables = [list(range(0, 20)), list(range(39, 19, -1))]  # out-of-order physical blocks
    out = []
    for query_lens, seq_lens, tokens, positions in (
            ([13, 9], [13, 9], torch.cat([ids[:13], ids[30:39]]), list(range(13)) + list(range(9))),
            ([1, 12], [14, 21], torch.cat([ids[13:14], ids[39:51]]), [13] + list(range(9, 21)))):
        meta = kernels.build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
        out.append(model.forward(tokens, torch.tensor(positions), kv, meta, torch.arange(len(tokens))))
    return out


SIZES = (2, 4)


def _rank_main(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    """One rank of a world of max(SIZES); each size runs on the subgroup of the first `size` ranks."""
    import torch.distributed as dist

    from worker_svc.parallel.rank_group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=max(SIZES))
    for size in SIZES:
        sub = dist.new_group(list(range(size)))  # every rank of the world takes part in creating it
        if rank >= size:
            continue
        group = RankGroup(rank, size, rank, torch.device("cpu"), sub, sub)
        for i, path in enumerate(paths):
            config, weights = load_hf_dir(path, Shard(rank, size))
            model = LlamaModel(local_config(config, size), weights, torch.float32, "cpu", tp=group)
            logits = _steps(model)
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"{size}-{i}.pt"))
            else:
                assert all(x is None for x in logits)
        for i, path in enumerate(paths if size == 2 else []):  # the compiled forward, parts padded to 16 / 32 rows
            config, weights = load_hf_dir(path, Shard(rank, size))
            model = CompiledForward(LlamaModel(local_config(config, size), weights, torch.float32, "cpu", tp=group,
                                               prepack=False),
                                    CompilationConfig(cudagraph_capture_sizes=(16, 32),
                                                      cache_dir=os.path.join(out_dir, "inductor")))
            before = counters["stats"]["unique_graphs"]
            model.warm_up()
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > before, "warm-up compiled nothing"
            logits = _steps(model)
            assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph"
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"compiled-{i}.pt"))
        if size == 2:  # the Triton kernels (interpreter on CPU) on a sharded pool
            config, weights = load_hf_dir(paths[0], Shard(rank, size))
            model = LlamaModel(local_config(config, size), weights, torch.float32, "cpu", tp=group,
                               attention=kernels.get_backend("triton"))
            logits = _steps(model)
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, "triton.pt"))
    dist.destroy_process_group()


def test_sharded_logits_match_one_rank(checkpoints, tmp_path):
    expected = []
    for path in checkpoints:
        config, weights = load_hf_dir(path)
        for size in SIZES:
            check_shardable(config, size)
        expected.append(_steps(LlamaModel(config, weights, torch.float32, "cpu")))
    mp.spawn(_rank_main, args=(free_port(), checkpoints, str(tmp_path)), nprocs=max(SIZES), join=True)
    for size in SIZES:
        for i, want in enumerate(expected):
            got = torch.load(tmp_path / f"{size}-{i}.pt")
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape
                diff = (g - w).abs().max().item()
                assert diff < 1e-4, f"{checkpoints[i]} N={size}: max abs logit diff {diff}"
    for i, want in enumerate(expected):
        for g, w in zip(torch.load(tmp_path / f"compiled-{i}.pt"), want, strict=True):
            diff = (g - w).abs().max().item()
            assert diff < 1e-4, f"{checkpoints[i]} compiled, N=2: max abs logit diff {diff}"
    for g, w in zip(torch.load(tmp_path / "triton.pt"), expected[0], strict=True):
        diff = (g - w).abs().max().item()
        assert diff < 1e-3, f"triton backend, N=2: max abs logit diff {diff}"  # as tests/e2e/test_triton_e2e.py


def test_shard_validation_names_the_flag_and_head_counts(checkpoints):
    config, _ = load_hf_dir(checkpoints[0])
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide the model's 8 attention heads"):
        check_shardable(config, 3)
    config.intermediate_size = 162
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide the model's intermediate"):
        check_shardable(config, 4)
    config.num_heads, config.num_kv_heads = 12, 4
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 6 and the model's 4 KV heads"):
        check_shardable(config, 6)
