"""LoRA under tensor parallelism: two gloo ranks, each holding its shard of the weights and of the adapters (B's
rows for q/k/v, gate, up; A's columns for o, down, whose partial deltas join the all-reduce), give the logits of
one rank with the same adapters, for Llama (8 query heads, 2 KV heads) and Gemma 2 (its norms come after the
row-parallel reduce). One step mixes two adapters and the base model. The other ranks' pools follow rank 0's
through the step message (slots written, token slots), as a worker group's do; a two-rank ModelRunner group serves
requests of both adapters and the base model in one batch with the greedy tokens of one rank."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import kernels
from llmserve.processes import free_port
from tests.e2e.test_tensor_parallel import BLOCK_SIZE, NUM_BLOCKS
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.model.lora import LoraPool
from worker_svc.parallel.rank_group import StepInputs, step_inputs
from worker_svc.parallel.sharding import FULL, Shard, local_config

SIZE = 2
ROWS = np.array([0, 1, 2])  # batch rows of the three sequences: adapter "all", adapter "attn", the base model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[tuple[str, dict[str, str]]]:
    import transformers

    from tests.service.test_model_families import make_checkpoint
    from tests.support.lora_adapters import ATTN, write_adapter
    from tests.support.random_weights import randomize

    out = []
    for family in ("llama", "gemma2"):
        path = tmp_path_factory.mktemp(family)
        if family == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False))
            randomize(model)
            model.eval().save_pretrained(path, safe_serialization=True)
        else:
            make_checkpoint(family, path, max_position_embeddings=256)
        cfg = transformers.AutoConfig.from_pretrained(path)
        adapters = {"all": write_adapter(str(path / "all"), cfg, rank=8, alpha=16, seed=1, std_b=0.3),
                    "attn": write_adapter(str(path / "attn"), cfg, rank=4, alpha=8, modules=ATTN, seed=2,
                                          std_b=0.3)}
        out.append((str(path), adapters))
    return out


def _pool(config, shard: Shard) -> LoraPool:
    return LoraPool(config, max_loras=2, max_rank=8, max_cpu_loras=2, dtype=torch.float32, device=torch.device("cpu"),
                    shard=shard)


SEQ_ROWS = ([7, 9, 5], [1, 6, 4])  # each step's tokens per sequence


def _steps(model, pool: LoraPool | None, sync=None) -> list[torch.Tensor]:
    """Logits of every row of two steps over three sequences: prefill chunks, then a decode row and two chunks.
    `sync(pool, query_lens)` (in a group) runs before each forward instead of `begin_step`: the step message."""
    kv = torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=gen)
    tables = [list(range(0, 12)), list(range(39, 27, -1)), list(range(12, 24))]
    out = []
    for query_lens, seq_lens, tokens, positions in (
            (SEQ_ROWS[0], [7, 9, 5], torch.cat([ids[:7], ids[20:29], ids[40:45]]),
             list(range(7)) + list(range(9)) + list(range(5))),
            (SEQ_ROWS[1], [8, 15, 9], torch.cat([ids[7:8], ids[29:35], ids[45:49]]),
             [7] + list(range(9, 15)) + list(range(5, 9)))):
        if sync is not None:
            sync(pool, query_lens)
        elif pool is not None:
            pool.begin_step(ROWS, np.array(query_lens))
        meta = kernels.build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
        out.append(model.forward(tokens, torch.tensor(positions), kv, meta, torch.arange(len(tokens))))
    return out


def _model(path: str, adapters: dict[str, str] | None, shard: Shard, group=None):
    """The model of `path` for `shard`, with a pool holding both adapters on rows 0 and 1 (None: no LoRA)."""
    config, weights = load_hf_dir(path, shard)
    model = models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                                tp=group)
    if adapters is not None:
        model.lora = pool = _pool(config, shard)
        slots = [pool.activate(name, p, set()) for name, p in adapters.items()]
        pool.set_rows(ROWS, np.array([*slots, -1]))
    return model


def _rank_main(rank: int, port: int, checkpoints, out_dir: str) -> None:
    import torch.distributed as dist

    from worker_svc.parallel.rank_group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=SIZE)
    group = RankGroup(rank, SIZE, rank, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    for i, (path, adapters) in enumerate(checkpoints):
        model = _model(path, adapters if rank == 0 else None, Shard(rank, SIZE), group)
        if rank == 0:
            torch.save(_steps(model, model.lora, sync=lambda pool, lens: _lead(group, pool, lens)),
                       os.path.join(out_dir, f"{i}.pt"))
        else:  # a follower: an empty pool, filled from rank 0's messages
            config, _ = load_hf_dir(path, FULL)
            model.lora = _pool(config, Shard(rank, SIZE))
            assert all(x is None for x in _steps(model, model.lora, sync=lambda pool, lens: _follow(group, pool)))
    dist.destroy_process_group()


def _empty_copies() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)


def _lead(group, pool: LoraPool, query_lens: list[int]) -> None:
    pool.begin_step(ROWS, np.array(query_lens))
    group.send_step(step_inputs(_empty_copies(), None, *pool.sync_message()))


def _follow(group, pool: LoraPool) -> None:
    step = group.receive()
    pool.follow(step.lora_slots, step.lora_written)


def test_tp2_with_adapters_equals_one_rank(checkpoints, tmp_path):
    expected = [_steps(m := _model(path, adapters, FULL), m.lora) for path, adapters in checkpoints]
    base = [_steps(_model(path, None, FULL), None) for path, _ in checkpoints]
    mp.spawn(_rank_main, args=(free_port(), checkpoints, str(tmp_path)), nprocs=SIZE, join=True)
    for i, want in enumerate(expected):
        got = torch.load(tmp_path / f"{i}.pt")
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            diff = (g - w).abs().max().item()
            assert diff < 1e-4 * max(1.0, w.abs().max().item()), f"{checkpoints[i][0]}: max abs logit diff {diff}"
    for w, b, lens in zip(expected[0], base[0], SEQ_ROWS, strict=True):  # the adapters' rows change, the base's not
        adapted = lens[0] + lens[1]
        assert ((w[:adapted] - b[:adapted]).abs().amax(dim=-1) > 1e-3).all(), "an adapter changes nothing"
        assert torch.allclose(w[adapted:], b[adapted:], atol=1e-5)


def test_step_message_carries_slots_and_adapters(checkpoints):
    """A follower's pool, fed rank 0's messages, holds what a pool of its shard that activated them itself holds."""
    path, adapters = checkpoints[0]
    config, _ = load_hf_dir(path, FULL)
    first, follower, direct = (_pool(config, Shard(r, SIZE)) for r in (0, 1, 1))
    for name, p in adapters.items():
        first.activate(name, p, set())
        direct.activate(name, p, set())
    first.set_rows(ROWS, np.array([0, 1, -1]))
    first.begin_step(ROWS, np.array([2, 3, 1]))
    header, payload = step_inputs(_empty_copies(), None, *first.sync_message()).pack()
    step = StepInputs.unpack(header, payload)
    follower.follow(step.lora_slots, step.lora_written)
    assert follower.slot_of == direct.slot_of
    assert step.lora_slots.tolist() == [0, 0, 1, 1, 1, -1]
    for g in direct.a:
        assert torch.equal(follower.a[g], direct.a[g]) and torch.equal(follower.b[g], direct.b[g])
    assert len(first.sync_message()[1]) == 0  # sent once


def _runner_rank(rank: int, port: int, path: str, adapters: dict[str, str], prompts, out_dir: str) -> None:
    """A worker group's rank: rank 0 serves the requests through `execute`, the other follows its messages."""
    import torch.distributed as dist

    from tests.service.test_lora_worker import drive
    from worker_svc.config import WorkerConfig
    from worker_svc.core.runner import ModelRunner
    from worker_svc.parallel.rank_group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=SIZE)
    group = RankGroup(rank, SIZE, rank, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    runner = ModelRunner(_runner_config(path, WorkerConfig, SIZE), group)
    if rank == 0:
        torch.save(drive(runner, _requests(adapters, prompts), chunk=16), os.path.join(out_dir, "group.pt"))
        group.stop_others()
    else:
        runner.follow()
    dist.destroy_process_group()


def _runner_config(path: str, config_cls, size: int):
    return config_cls(model=path, dtype="float32", device="cpu", num_gpu_blocks_override=64, enable_lora=True,
                      max_loras=2, max_lora_rank=8, tensor_parallel_size=size)


def _requests(adapters: dict[str, str], prompts: list[list[int]]) -> list:
    """Greedy requests of every prompt under the base model and each adapter: one batch mixes all three."""
    from tests.service.test_lora_worker import greedy
    from tests.support.driver import DriverRequest

    return [DriverRequest(f"{name}-{i}", p, greedy(), lora_name=name, lora_path=adapters.get(name, ""))
            for name in ["", *adapters] for i, p in enumerate(prompts)]


# slow: a second two-rank run of the same property at the runner's level; by default the logits of both families
# (test_tp2_with_adapters_equals_one_rank), the follower's pool from the step message (the test above), a served
# tensor-parallel group (tests/e2e/test_tensor_parallel_e2e.py) and one rank's runner with adapters
# (tests/service/test_lora_worker.py) run.
@pytest.mark.slow
def test_worker_group_with_adapters_equals_one_rank(checkpoints, tmp_path):
    """ModelRunner on two ranks, requests of both adapters and the base model in one batch: rank 0's step messages
    carry the adapters and token slots, and the greedy tokens equal one rank's."""
    from tests.service.test_lora_worker import drive
    from worker_svc.config import WorkerConfig
    from worker_svc.core.runner import ModelRunner

    path, adapters = checkpoints[0]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (11, 30)]
    runner = ModelRunner(_runner_config(path, WorkerConfig, 1))
    want = drive(runner, _requests(adapters, prompts), chunk=16)
    assert len({tuple(t) for t in want}) == len(want), "an adapter changes nothing: the test would prove nothing"
    mp.spawn(_runner_rank, args=(free_port(), path, adapters, prompts, str(tmp_path)), nprocs=SIZE, join=True)
    assert torch.load(tmp_path / "group.pt") == want
