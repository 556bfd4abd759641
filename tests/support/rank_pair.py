"""Run one function on every rank of a real gloo group (one process per rank) and bring rank 0's results back.

The tensor-parallel logit tests all have this shape: load a checkpoint sharded per rank, run the same steps, and
compare rank 0's logits with one unsharded rank's. Only rank 0 returns logits (the others return None for each step:
the all-gathered head's output lives on rank 0), so the helper checks that too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from llmserve.processes import free_port
from worker_svc.parallel.sharding import Shard

# run_rank(path, shard, group) -> (logits per step, extra): what rank 0 saves is both; other ranks' logits are None.
RankFn = Callable[[str, Shard, Any], tuple[list[Any], Any]]


def _rank_main(rank: int, size: int, port: int, paths: list[str], out_dir: str, run_rank: RankFn) -> None:
    import torch.distributed as dist

    from worker_svc.parallel.rank_group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a two-core box: one thread each
    dist.init_process_group("gloo", rank=rank, world_size=size)
    group = RankGroup(rank, size, rank, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    for i, path in enumerate(paths):
        logits, extra = run_rank(path, Shard(rank, size), group)
        if rank == 0:
            torch.save((logits, extra), os.path.join(out_dir, f"{i}.pt"))
        else:
            assert all(x is None for x in logits)
    dist.destroy_process_group()


def run_on_ranks(run_rank: RankFn, paths: list[str], out_dir: str, size: int = 2) -> list[tuple[list[Any], Any]]:
    """rank 0's (logits, extra) per path, run_rank having run on `size` ranks (a module-level function: spawn pickles
    it by name)."""
    mp.spawn(_rank_main, args=(size, free_port(), paths, out_dir, run_rank), nprocs=size, join=True)
    return [torch.load(os.path.join(out_dir, f"{i}.pt")) for i in range(len(paths))]
