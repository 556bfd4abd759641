"""The C++ decode attention (kernels/csrc/paged_attention.cpp's `decode_attention`) over 30 layers of a paged KV cache
on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64, blocks of 16): the numbers in kernels/README.md.

Two placements of the cache: `memory`, a cache per layer (at batch 64 and context 192, ~300 MB in bfloat16: every
call reads its layer from memory, as a decode step does), and `l3`, one layer's cache read by all 30 calls (it stays
in the last-level cache: the kernel's own speed). `--library` loads another build of the kernels (a `.so` from
`~/.cache/llmserve/cpu_ops/<hash>/`, e.g. a previous revision's) to compare; run each in its own process, one after
the other. Prints the median of `--repeats` passes over the 30 layers and a digest of the output bits, which must
match between builds that claim the same results. `--shuffle` hands each sequence its blocks in random order (a
server's pool after some traffic) instead of in sequence.

    .venv/bin/python -m experiments.decode_attention_layers --cases 1x192,16x512,64x192
    .venv/bin/python -m experiments.decode_attention_layers --library \
        ~/.cache/llmserve/cpu_ops/<hash>/llmserve_cpu_ops_x86_64_v3.so
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from kernels import cpu_ops

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The median of `repeats` timed calls of fn, in ms, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def time_layers(ops: object, query: torch.Tensor, rows: object, cache: torch.Tensor, out: torch.Tensor,
                repeats: int) -> float:
    """Median ms of one pass over LAYERS layers, layer l reading cache[l % len(cache)]."""

    def run() -> None:
        for layer in range(LAYERS):
            kv = cache[layer % cache.shape[0]]
            ops.decode_attention(query, rows.rows, kv[0], kv[1], rows.tables, rows.seq_lens, D ** -0.5, 0, 0.0, None,
                                 out)

    return median_ms(run, repeats, warmup=3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x192,16x512,64x192", help="BATCHxCONTEXT, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--shuffle", action="store_true",
                   help="block ids in random order (as a server's free list hands them out), not in sequence")
    p.add_argument("--library", default=None, help="a built kernels module to load instead of this checkout's")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    ops = cpu_ops._import(Path(a.library).expanduser()) if a.library else cpu_ops.load()
    if ops is None:
        raise SystemExit("the C++ kernels are not built here (kernels/cpu_ops.py)")
    dtype = getattr(torch, a.dtype)
    for case in a.cases.split(","):
        batch, context = (int(v) for v in case.split("x"))
        blocks = -(-(context + 1) // BS)
        ids = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(1)) if a.shuffle \
            else torch.arange(batch * blocks)
        tables = ids.view(batch, blocks).tolist()
        rows = kernels.build_attention_metadata([1] * batch, [context + 1] * batch, tables, BS, "cpu").plan.kernel_rows
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(batch, HQ, D, generator=generator).to(dtype)
        out = torch.empty(batch, HQ, D, dtype=dtype)
        for placement, copies in (("memory", LAYERS), ("l3", 1)):
            cache = torch.randn(copies, 2, blocks * batch, BS, HKV, D, generator=generator).to(dtype)
            ms = time_layers(ops, query, rows, cache, out, a.repeats)
            digest = hashlib.sha256(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                                    .numpy().tobytes()).hexdigest()[:12]
            print(f"batch {batch:3d} context {context:5d} {placement:6s}: {ms:7.2f} ms "
                  f"over {LAYERS} layers, output {digest}", flush=True)
            del cache


if __name__ == "__main__":
    main()
