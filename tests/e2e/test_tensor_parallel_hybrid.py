"""Tensor parallel 2 equals 1 for the hybrid families (Gated DeltaNet: Qwen3-Next with its MoE, Qwen3.5; Mamba2:
Nemotron-H, Granite 4.0 hybrid with its MoE): the recurrent layers split by heads (and Mamba2's groups), each rank's
state pool holding its shard of every slot.

- the model on two gloo ranks, each loading only its slices of a transformers-written random checkpoint: the logits
  of every row of chunked prefill and decode steps, from the states the slots carry, equal one rank's;
- a served worker on `--tensor-parallel-size 2` behind a real scheduler and redis-server: greedy tokens equal
  transformers' for mixed prompts, an n = 2 request and a repeated prompt that hits a state snapshot (the state
  copies and saves of each plan reach both ranks' pools);
- a head count that the size does not divide is refused at start, naming the field and the size.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.e2e.test_hybrid_serving import generate, reference, token_prompt
from tests.e2e.test_prefix_cache import metrics
from tests.support import cluster
from tests.support.rank_pair import run_on_ranks
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import Shard, check_shardable, local_config

FAMILIES = ("qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid")
SIZE = 2
BLOCK = 16
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    from tests.service.test_hybrid_families import make_checkpoint  # transformers: not in every spawned rank

    paths = []
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(f"{name}-tp")
        make_checkpoint(name, path)
        paths.append(str(path))
    return paths


def _load(path: str, shard: Shard, group=None, **kwargs):
    config, weights = load_hf_dir(path, shard)
    return models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                               tp=group, **kwargs)


def _steps(model) -> list[torch.Tensor | None]:
    """Logits of every row of three steps of two sequences in slots 3 and 1: prefill chunks of 13 and 9 tokens,
    then one decode row beside a 12-token chunk, then two decode rows."""
    cache = StateCache(model.state_shape(), 5, torch.float32, torch.float32, torch.device("cpu"))
    cache.zero(torch.tensor([3, 1]))
    kv = torch.zeros(model.kv_cache_shape(16, BLOCK))
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1))
    tables = [list(range(0, 8)), list(range(15, 7, -1))]
    out = []
    for lens, starts in (([13, 9], [0, 0]), ([1, 12], [13, 9]), ([1, 1], [14, 21])):
        tokens = torch.cat([ids[30 * i + s:30 * i + s + n] for i, (n, s) in enumerate(zip(lens, starts, strict=True))])
        positions = torch.cat([torch.arange(s, s + n) for n, s in zip(lens, starts, strict=True)])
        meta = kernels.build_attention_metadata(lens, [s + n for n, s in zip(lens, starts, strict=True)], tables,
                                                BLOCK, "cpu")
        step = StateStep(cache, torch.tensor([3, 1]), meta.cu_seqlens_q.long())
        out.append(model.forward(tokens, positions, kv, meta, torch.arange(len(tokens)), state=step))
    return out


def _rank_steps(path: str, shard: Shard, group) -> tuple[list[torch.Tensor | None], None]:
    return _steps(_load(path, shard, group)), None


def test_tp2_logits_equal_one_rank(checkpoints, tmp_path):
    expected = [_steps(_load(path, Shard(0, 1))) for path in checkpoints]
    got = run_on_ranks(_rank_steps, checkpoints, str(tmp_path), SIZE)
    for i, want in enumerate(expected):
        for g, w in zip(got[i][0], want, strict=True):
            assert g.shape == w.shape
            diff = (g - w).abs().max().item()
            assert diff < 1e-4 * max(1.0, w.abs().max().item()), f"{FAMILIES[i]} N=2: max abs logit diff {diff}"


def test_a_size_that_does_not_divide_the_recurrent_heads_is_refused(checkpoints):
    config, _ = load_hf_dir(checkpoints[1])  # Qwen3.5: 2 key heads, 4 attention heads
    config.num_heads, config.num_kv_heads, config.intermediate_size = 12, 4, 96
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide the model's "
                                         r"linear_num_key_heads 2"):
        check_shardable(config, 4)
    config, _ = load_hf_dir(checkpoints[2])  # Nemotron-H: 8 Mamba2 heads in 2 groups
    config.num_heads, config.num_kv_heads, config.intermediate_size = 4, 4, 96
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide the model's n_groups 2"):
        check_shardable(config, 4)


def test_served_on_two_ranks_equals_transformers(redis_server, checkpoints, tmp_path):
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_hybrid_families import make_checkpoint

    path = tmp_path / "qwen3_5"
    hf = make_checkpoint("qwen3_5", path)
    word_tokenizer(path, hf.config.vocab_size)
    worker = cluster.start_worker(["--model", str(path), "--tensor-parallel-size", SIZE, "--num-gpu-blocks-override",
                                   24, "--max-model-len", 256, "--allow-kv-pool-below-max-model-len",
                                   "--num-state-slots", 6], timeout=TIMEOUT_S)
    metrics_port = cluster.free_port()
    sched = cluster.start_scheduler(redis_server, worker, ["--max-num-batched-tokens", 32, "--debug-invariants",
                                                           "--metrics-port", metrics_port],
                                    namespace=cluster.new_namespace("hybrid-tp"))
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        for seed, (n, max_tokens) in enumerate([(45, 10), (20, 16)]):
            p = token_prompt(n, 300 + seed)
            assert generate(sched.address, p, max_tokens) == [reference(hf, p, max_tokens)]
        p = token_prompt(40, 400)
        expected = reference(hf, p, 8)
        assert generate(sched.address, p, 8, n=2) == [expected, expected]  # the sibling from the prompt's snapshot
        hits = metrics(metrics_port).get("vllm:prefix_cache_hits_total", 0)
        assert generate(sched.address, p, 8) == [expected]
        assert metrics(metrics_port)["vllm:prefix_cache_hits_total"] - hits == 32
    finally:
        cluster.stop(sched)
        cluster.stop(worker)
