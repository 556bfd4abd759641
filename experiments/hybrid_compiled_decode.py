"""Decode tok/s of a hybrid model's forward at -O0 (the eager forward, CPU-prepacked weights) against -O1 (the compiled
forward, worker_svc/model/compiled_hybrid.py, dense weights), interleaved in one process on the same checkpoint.

A random-weight checkpoint is written by transformers (experiments/hybrid_forward.py's shape: every 4th layer
attention); B sequences are prefilled C tokens each from zero state, then one decode step of B rows is timed per
mode and repetition, the modes in rotating order so a shared machine's load hits both alike (each step rewrites the
same position, so the context stays C). The compiled forward is built with one size, B (no padding). The table shows
medians; tok/s = B / median seconds. The load average is printed before and after.

    .venv/bin/python -m experiments.hybrid_compiled_decode
    .venv/bin/python -m experiments.hybrid_compiled_decode --family nemotron_h --batch 1 16 --layers 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch

import kernels
from experiments.hybrid_forward import BLOCK, checkpoint
from worker_svc.config import CompilationConfig
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.compiled_hybrid import CompiledHybridForward
from worker_svc.model.loader import load_hf_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen3_5", choices=["qwen3_5", "nemotron_h"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as path:
        checkpoint(args.family, args.layers, args.hidden, path)
        config, weights = load_hf_dir(path)
    cls = models.by_name(config.architecture)
    eager = cls(config, weights, torch.float32, "cpu")
    t = time.perf_counter()
    compiled = CompiledHybridForward(cls(config, weights, torch.float32, "cpu", prepack=False),
                                     CompilationConfig(tuple(args.batch)))
    compiled.warm_up()
    print(f"compiled sizes {args.batch} in {time.perf_counter() - t:.1f} s")
    print(f"| {args.family} ({args.layers} layers, hidden {args.hidden}, context {args.context}, threads "
          f"{args.threads}) | -O0 tok/s | -O1 tok/s | -O1 / -O0 |")
    print("|---|---|---|---|")
    for b in args.batch:
        runs = {name: Decode(model, b, args.context) for name, model in (("-O0", eager), ("-O1", compiled))}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for rep in range(args.reps + 1):
            for name in names[rep % 2:] + names[: rep % 2]:
                s = runs[name].step()
                if rep:  # the first repetition warms caches up
                    seconds[name].append(s)
        rate = {name: b / statistics.median(s) for name, s in seconds.items()}
        print(f"| decode {b} | {rate['-O0']:.0f} | {rate['-O1']:.0f} | {rate['-O1'] / rate['-O0']:.2f}x |",
              flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


class Decode:
    """B sequences of C tokens in their own pools; `step` times one decode step of all of them."""

    def __init__(self, model, b: int, c: int):
        self.model, self.b, self.c = model, b, c
        self.pool = StateCache(model.state_shape(), b, torch.float32, torch.float32, torch.device("cpu"))
        blocks = -(-(c + 1) // BLOCK)
        self.kv = torch.zeros(model.kv_cache_shape(b * blocks, BLOCK))
        self.tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
        self.ids = torch.randint(0, 8192, (b, c))
        self._forward(c, 0)  # the prefill: state and KV of C tokens

    def _forward(self, n: int, start: int) -> float:
        """The seconds of the forward alone (its inputs built before the timer)."""
        b = self.b
        meta = kernels.build_attention_metadata([n] * b, [start + n] * b, self.tables, BLOCK, "cpu")
        tokens = self.ids[:, start:start + n].reshape(-1)
        state = StateStep(self.pool, torch.arange(b), meta.cu_seqlens_q.long())
        positions, rows = torch.arange(start, start + n).repeat(b), torch.arange(1, b + 1) * n - 1
        t = time.perf_counter()
        self.model.forward(tokens, positions, self.kv, meta, rows, state=state)
        return time.perf_counter() - t

    def step(self) -> float:
        return self._forward(1, self.c - 1)

if __name__ == "__main__":
    main()
