"""The matmul over panels (kernels/csrc/dense_matmul.cpp; float32, or bfloat16 on an AVX-512 CPU) against
oneDNN's prepacked matmul in the same dtype, on SmolLM2-135M's weight shapes at several row counts: the numbers in
kernels/README.md.

Each shape's weights are rotated through ~64 MB of copies so that every call reads them from memory, as a decode
step does; the two kernels run back to back per shape and row count, and the table shows medians.

    python -m experiments.dense_matmul [--dtype float32|bfloat16] [--rows 1,4,16,64,256] [--repeats 100]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kernels import cpu_ops
from worker_svc.cpu.panel_linear import PanelLinear
from worker_svc.model.layers.linear import panels_available, prepack_linear_weight

SHAPES = [(576, 576), (960, 576), (1536, 576), (576, 1536), (49152, 576)]  # o, qkv, gate/up, down, the head


def median_us(matmuls: list[Callable[[torch.Tensor], object]], x: torch.Tensor, repeats: int) -> float:
    """Median microseconds of one call, each call on the next weight copy."""
    for i in range(3):
        matmuls[i % len(matmuls)](x)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        matmuls[i % len(matmuls)](x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def onednn_matmul(packed: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,4,16,64,256", help="activation rows, comma-separated")
    p.add_argument("--shapes", default=None, help="N x K pairs, e.g. 576x576,49152x576 (default: SmolLM2's)")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--rotate-mb", type=float, default=64.0, help="weight copies per shape up to this many MB")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if not panels_available(dtype):
        raise SystemExit(f"the {args.dtype} panel kernel is not built here (float32 needs AVX2 + FMA, bfloat16 "
                         "AVX-512, both a C++ compiler)")
    torch.set_num_threads(args.threads)
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    ops = cpu_ops.load()
    results = []
    print("| N x K | rows | oneDNN us (GB/s) | panels us (GB/s) | oneDNN / panels | max abs diff from float64 |\n"
          "|---|---:|---:|---:|---:|---:|")
    for n, k in shapes:
        size = dtype.itemsize
        copies = max(1, int(args.rotate_mb * 1e6 / (n * k * size)))
        dense = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        onednn = [onednn_matmul(prepack_linear_weight(w)) for w in dense]
        panels = [PanelLinear(w, ops) for w in dense]
        gb = n * k * size / 1e9
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            exact = torch.nn.functional.linear(x.double(), dense[0].double())
            diff = (panels[0](x).double() - exact).abs().max().item()
            a = median_us(onednn, x, args.repeats)
            b = median_us(panels, x, args.repeats)
            results.append({"n": n, "k": k, "rows": m, "onednn_us": a, "panels_us": b, "max_abs_diff": diff})
            print(f"| {n} x {k} | {m} | {a:.0f} ({gb / a * 1e6:.1f}) | {b:.0f} ({gb / b * 1e6:.1f}) | {a / b:.2f} "
                  f"| {diff:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "dtype": args.dtype, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
