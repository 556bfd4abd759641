"""Whether the quantized CPU matmuls (kernels/csrc/quant_matmul.cpp) are held back by memory or by their own
instructions at one activation row: each of SmolLM2-135M's quantized shapes (the bundled Q4_1 layers as int4, the
Q8_0 head as int8, int8 activations as `--activation-quantization int8` runs them) timed reading its weights from
memory (rotated through copies of ~64 MB) and from cache (one copy, called again and again), next to a torch `sum`
over the same bytes from memory. A kernel that is no faster from cache than from memory, and slower than the sum,
is compute-bound: fewer bytes would not speed it up, fewer instructions per weight group would. The last line is one
sum over all the rotated bytes in one call: the streaming rate a whole forward's weights could be read at.

    python -m experiments.quant_matmul_rate [--repeats 200] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from worker_svc.model import quant

# (name, N, K, bits): q + k + v, o, gate + up, down (int4 from Q4_1), the head (int8 from Q8_0)
SHAPES = [("qkv", 960, 576, 4), ("o", 576, 576, 4), ("gate_up", 3072, 576, 4), ("down", 576, 1536, 4),
          ("head", 49152, 576, 8)]


def random_weight(n: int, k: int, bits: int) -> quant.QuantizedWeight:
    """Codes and group scales (and int4 zeros) of the shapes and dtypes a GGUF file gives."""
    groups = (n, k // quant.GROUP)
    if bits == 4:
        return quant.QuantizedWeight(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(groups) * 0.01,
                                     torch.randn(groups) * 0.01, 4, "Q4_1")
    return quant.QuantizedWeight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(groups) * 0.01,
                                 None, 8, "Q8_0")


def median_us(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median microseconds of one call, each call the next in `calls`."""
    for i in range(3):
        calls[i % len(calls)]()
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def quant_linear(rows: int, k: int, bits: int) -> quant.QuantLinear:
    cpu = torch.device("cpu")
    w = quant.with_integer_activations({"w": random_weight(rows, k, bits)}, 8, cpu)["w"]
    return quant.QuantLinear(w, torch.float32, cpu)


def weight_bytes(q: quant.QuantLinear) -> int:
    return q.codes.nbytes + q.scale.nbytes + (0 if q.bits == 8 else q.zero.nbytes)


def measure(name: str, n: int, k: int, bits: int, repeats: int, rotate_mb: float) -> dict:
    """One shape's microseconds from cache (scaled from a ~1 MB slice of rows to all n), from memory, and for a
    torch sum over as many bytes from memory."""
    row_bytes = weight_bytes(quant_linear(16, k, bits)) // 16
    nbytes = row_bytes * n
    cached = quant_linear(min(n, max(16, int(1e6 / row_bytes) // 16 * 16)), k, bits)
    rotated = [quant_linear(n, k, bits) for _ in range(max(2, int(rotate_mb * 1e6 / nbytes)))]
    x = torch.randn(1, k)
    flat = torch.randn(int(max(rotate_mb * 1e6, 2 * nbytes) / 4))
    chunk = max(1, nbytes // 4)
    sums = [lambda i=i: flat[i * chunk:(i + 1) * chunk].sum() for i in range(max(1, flat.numel() // chunk))]
    return {"name": name, "n": n, "k": k, "bits": bits, "bytes": nbytes,
            "cache_us": median_us([lambda: cached(x)], repeats) * n / cached.out_features,
            "memory_us": median_us([lambda q=q: q(x) for q in rotated], repeats),
            "sum_us": median_us(sums, repeats)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rotate-mb", type=float, default=64.0, help="weight copies per shape up to this many MB")
    p.add_argument("--shapes", default=None, help="names of SHAPES to run, comma-separated (default: all)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if quant.cpu_kernels() is None:
        raise SystemExit("the quantized CPU kernels are not built here (needs AVX2 + FMA and a C++ compiler)")
    torch.set_num_threads(args.threads)
    wanted = None if args.shapes is None else set(args.shapes.split(","))
    results = []
    print("| weight | N x K | bits | MB | from cache GB/s | from memory GB/s | sum from memory GB/s | memory / sum |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for name, n, k, bits in SHAPES:
        if wanted is not None and name not in wanted:
            continue
        row = measure(name, n, k, bits, args.repeats, args.rotate_mb)
        results.append(row)
        cache, memory, summed = (row["bytes"] / row[t] / 1e3 for t in ("cache_us", "memory_us", "sum_us"))
        print(f"| {name} | {n} x {k} | {bits} | {row['bytes'] / 1e6:.2f} | {cache:.1f} | {memory:.1f} | {summed:.1f} "
              f"| {memory / summed:.2f} |", flush=True)
    big = torch.randn(int(args.rotate_mb * 1e6 / 4))
    stream_us = median_us([lambda: big.sum()], max(3, args.repeats // 20))
    stream = big.nbytes / stream_us / 1e3
    print(f"\nOne torch sum over {big.nbytes / 1e6:.0f} MB in one call (the streaming rate): {stream:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "stream_gbs": stream, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
