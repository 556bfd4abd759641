"""Tensor-parallel decode on this CPU: N = 1 rank with T threads against N ranks with T / N threads each.

Each configuration is a fresh gloo group of N processes (torch.multiprocessing), each holding its shard of one
model (tensor_parallel.shard_weights) and of a paged KV pool, running the bare `LlamaModel.forward` of one decode
step: B sequences with C cached tokens, one new token each (metadata built outside the timer; the KV values do
not change the work). Every rank runs the same steps after a barrier; rank 0's wall time per step is reported
(median), with the time rank 0 spent inside the all-reduces and the logits gather of that step (gloo on CPU is
synchronous, so a perf_counter around each call measures it, waiting for slower ranks included). A separate loop
times one all-reduce of a [B, hidden] float32 tensor alone: the floor of each of the 2 x layers + 1 per step.

The model has SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocab 49152) with 8 query heads and 4 KV
heads of 72 (the bundled model's 9/3 heads do not split in two), random float32 weights.

    .venv/bin/python -m experiments.tensor_parallel                          # N=1 x 2 threads vs N=2 x 1 thread
    .venv/bin/python -m experiments.tensor_parallel --batch-sizes 1,8 --steps 3 --layers 2    # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # experiments/worker_forward.py: spinning threads, shared box

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.parallel.rank_group import RankGroup
from worker_svc.parallel.sharding import Shard, check_shardable, local_config, shard_weights

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1x2,2x1", help="ranks x threads per rank, comma-separated")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=30, help="decoder layers (fewer for a smoke run)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c.strip()]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    return args


def model_config(layers: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=72, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def random_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = cfg.hidden_size, cfg.head_dim

    def r(*shape: int) -> torch.Tensor:
        return 0.05 * torch.randn(*shape, generator=g)

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": r(cfg.num_heads * d, h),
              p + "self_attn.k_proj.weight": r(cfg.num_kv_heads * d, h),
              p + "self_attn.v_proj.weight": r(cfg.num_kv_heads * d, h),
              p + "self_attn.o_proj.weight": r(h, cfg.num_heads * d),
              p + "mlp.gate_proj.weight": r(cfg.intermediate_size, h),
              p + "mlp.up_proj.weight": r(cfg.intermediate_size, h),
              p + "mlp.down_proj.weight": r(h, cfg.intermediate_size)}
    return w


class TimedGroup(RankGroup):
    """RankGroup that adds the wall time of every model collective to `comm_s`."""

    comm_s = 0.0
    calls = 0

    def all_reduce(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        super().all_reduce(t)
        self.comm_s += time.perf_counter() - t0
        self.calls += 1

    def gather_to_first(self, t: torch.Tensor) -> torch.Tensor | None:
        t0 = time.perf_counter()
        out = super().gather_to_first(t)
        self.comm_s += time.perf_counter() - t0
        return out


def _rank(rank: int, size: int, threads: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    group = TimedGroup(rank, size, rank, torch.device("cpu"))
    cfg = model_config(args.layers)
    weights = shard_weights(cfg, random_weights(cfg), Shard(rank, size))
    model = LlamaModel(local_config(cfg, size), weights, torch.float32, "cpu", tp=group)
    del weights
    c = args.context
    per_seq = -(-(c + 1) // BLOCK_SIZE)
    kv = torch.zeros(model.kv_cache_shape(max(args.batch_sizes) * per_seq, BLOCK_SIZE))
    results = []
    for b in args.batch_sizes:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        meta = kernels.build_attention_metadata([1] * b, [c + 1] * b, tables, BLOCK_SIZE, "cpu")
        ids = torch.randint(0, cfg.vocab_size, (b,), generator=torch.Generator().manual_seed(b))
        pos = torch.full((b,), c, dtype=torch.int64)
        rows = torch.arange(b)
        walls, comms = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            group.comm_s, group.calls = 0.0, 0
            t0 = time.perf_counter()
            model.forward(ids, pos, kv, meta, rows)
            wall = time.perf_counter() - t0
            if step >= args.warmup:
                walls.append(wall)
                comms.append(group.comm_s)
        # One all-reduce of the step's activation, alone.
        x = torch.randn(b, cfg.hidden_size)
        ar = []
        for _ in range(20 if size > 1 else 0):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ar.append(time.perf_counter() - t0)
        results.append({"batch": b, "step_s": statistics.median(walls), "comm_s": statistics.median(comms),
                        "all_reduces_per_step": group.calls, "all_reduce_alone_s": statistics.median(ar) if ar else 0.0,
                        "walls": walls, "comms": comms})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    import tempfile

    from llmserve.processes import free_port

    cfg = model_config(args.layers)
    rows = []
    for size, threads in args.configs:
        check_shardable(cfg, size)
        print(f"N={size} x {threads} threads ...", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(_rank, args=(size, threads, free_port(), args, f.name), nprocs=size, join=True)
            for r in json.load(open(f.name)):
                rows.append({"ranks": size, "threads_per_rank": threads, **r})
    return rows


def table(rows: list[dict]) -> str:
    first = (rows[0]["ranks"], rows[0]["threads_per_rank"])
    base = {r["batch"]: r["step_s"] for r in rows if (r["ranks"], r["threads_per_rank"]) == first}
    lines = ["| ranks x threads | batch | step ms | tok/s | vs first | comm ms/step | comm share | all-reduces | "
             "one all-reduce alone µs |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b, s = r["batch"], r["step_s"]
        lines.append(f"| {r['ranks']} x {r['threads_per_rank']} | {b} | {s * 1e3:.1f} | {b / s:.1f} | "
                     f"{base[b] / s:.2f} | {r['comm_s'] * 1e3:.2f} | {r['comm_s'] / s:.0%} | "
                     f"{r['all_reduces_per_step']} | {r['all_reduce_alone_s'] * 1e6:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
