"""The bare `LlamaModel.forward` of one decode step in several modes, interleaved in one process, as ratios.

Modes: float32 (oneDNN-prepacked weights, the CPU default before bfloat16), bfloat16 with plain F.linear (what
`--dtype bfloat16` ran before its weights were prepacked) and bfloat16 prepacked (`--dtype auto` on a CPU with
AVX512-BF16 or AMX). Every repetition runs each mode once, in rotating order, so a shared machine's load hits all
modes alike; the table shows medians and the ratio to the first mode. The attention share is the time inside
`write_kv_cache` + `paged_attention` over the whole forward (a perf_counter around each call). The timer keeps those
modes on the Python layer loop; the `-cpp` modes run the same weights through the C++ layer loop
(worker_svc/cpu/layer_loop.py, bit-identical), untimed inside. `bfloat16-onednn-cpp` packs the bfloat16 weights for
oneDNN instead of the project's panels (what `--dtype auto` ran before the bfloat16 panel kernel).

    .venv/bin/python -m experiments.forward_modes --batch-sizes 1,16,64 --context 256
    .venv/bin/python -m experiments.forward_modes --batch-sizes 1,16 --context 2048 --modes bfloat16-packed
    .venv/bin/python -m experiments.forward_modes --modes float32,float32-compiled,bfloat16-packed,bfloat16-compiled
    .venv/bin/python -m experiments.forward_modes --modes bfloat16-packed,bfloat16-packed-cpp,float32,float32-cpp
    .venv/bin/python -m experiments.forward_modes --modes bfloat16-onednn-cpp,bfloat16-packed-cpp
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch

import kernels
from worker_svc.config import CompilationConfig
from worker_svc.core import kv_cache
from worker_svc.cpu import layer_loop
from worker_svc.model.compiled import CompiledForward
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import default_model_path, load_model_weights

BLOCK_SIZE = 16
# name: (dtype, prepack, compiled): the compiled modes run `-O1`'s forward (dense weights) at the batch sizes
MODES = {"float32": (torch.float32, None, False), "bfloat16-linear": (torch.bfloat16, False, False),
         "bfloat16-packed": (torch.bfloat16, True, False), "float32-compiled": (torch.float32, False, True),
         "bfloat16-compiled": (torch.bfloat16, False, True), "float32-cpp": (torch.float32, None, False),
         "bfloat16-packed-cpp": (torch.bfloat16, True, False), "bfloat16-onednn-cpp": (torch.bfloat16, True, False)}


class TimedAttention:
    """The reference backend, with the seconds spent in it summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def write_kv_cache(self, *a, **kw):
        t = time.perf_counter()
        kernels.write_kv_cache(*a, **kw)
        self.seconds += time.perf_counter() - t

    def paged_attention(self, *a, **kw):
        t = time.perf_counter()
        out = kernels.paged_attention(*a, **kw)
        self.seconds += time.perf_counter() - t
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--modes", default=",".join(list(MODES)[:3]), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--cache-dir", default=None, help="inductor cache of the compiled modes (default: llmserve's)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    modes = a.modes.split(",")
    config, weights = load_model_weights(a.model or default_model_path())
    blocks_each = -(-(a.context + 1) // BLOCK_SIZE)
    models, caches, timers = {}, {}, {}
    for name in modes:
        dtype, prepack, compiled = MODES[name]
        timers[name] = TimedAttention()
        cpp = name.endswith("-cpp")  # the default backend: the C++ loop is built for it
        # oneDNN's packing: the panel kernel hidden from the model's packing for bfloat16
        onednn = mock.patch("worker_svc.model.layers.linear.panels_available", lambda d: d == torch.float32) \
            if "onednn" in name else contextlib.nullcontext()
        with onednn:
            models[name] = LlamaModel(config, weights, dtype, "cpu", prepack=prepack,
                                      **({} if cpp else {"attention": timers[name]}))
        if cpp and (loop := layer_loop.build(models[name])) is None:
            raise SystemExit(f"{name}: the C++ layer loop is not built here (kernels/cpu_ops.py)")
        if cpp:
            models[name] = loop  # as the runner serves it
        if compiled:
            models[name] = CompiledForward(models[name], CompilationConfig(tuple(batch_sizes), cache_dir=a.cache_dir))
            t = time.perf_counter()
            models[name].warm_up()
            print(f"{name}: compiled sizes {batch_sizes} in {time.perf_counter() - t:.1f} s", flush=True)
        caches[name] = kv_cache.allocate(config, blocks_each * max(batch_sizes), BLOCK_SIZE, dtype,
                                         torch.device("cpu")).normal_()
    del weights
    print(f"threads {a.threads}, context {a.context}, {a.repeats} interleaved repeats; ms (ratio to {modes[0]}), "
          "attention share")
    for b in batch_sizes:
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(b)]
        ids, pos, rows = torch.randint(0, 1000, (b,)), torch.full((b,), a.context), torch.arange(b)
        meta = {}
        for name in modes:  # a plan per mode: its gather buffers follow the cache's dtype
            meta[name] = kernels.build_attention_metadata([1] * b, [a.context + 1] * b, tables, BLOCK_SIZE, "cpu")
            models[name].forward(ids, pos, caches[name], meta[name], rows)  # warm-up
        wall = {n: [] for n in modes}
        attn = {n: [] for n in modes}
        for r in range(a.repeats):
            for name in modes[r % len(modes):] + modes[:r % len(modes)]:
                timers[name].seconds = 0.0
                t = time.perf_counter()
                models[name].forward(ids, pos, caches[name], meta[name], rows)
                wall[name].append(time.perf_counter() - t)
                attn[name].append(timers[name].seconds)
        base = statistics.median(wall[modes[0]])
        cells = []
        for name in modes:
            m = statistics.median(wall[name])
            share = statistics.median(x / w for x, w in zip(attn[name], wall[name], strict=True))
            shown = "-" if name.endswith("-cpp") else f"{share:.0%}"
            cells.append(f"{name} {m * 1e3:.1f} ms ({m / base:.2f}x) attn {shown}")
        print(f"batch {b:3d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
