"""What an FP8 weight costs in a CPU matmul: one layer's seven projections (Llama-3.2-1B's shapes by default) at
each row count of `--rows` (1: a decode step; hundreds: a prefill chunk) in bfloat16, as dense bfloat16 (F.linear,
and packed as the worker packs it) against FP8 kept (quant.QuantLinear on the project's CPU kernel `fp8_matmul`,
what the worker runs) and FP8 dequantized by torch into bfloat16 in every call (the path CUDA runs, and the
alternative for large prefills: a scratch copy of the weight per call).

    python -m experiments.fp8_matmul_cost [--hidden 2048 --intermediate 8192 --kv 512 --layers 16 --rows 1,64,512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker_svc.model import quant
from worker_svc.model.hf_quant import fp8_weight
from worker_svc.model.layers.linear import linear, pack_linear_weight, prepack_supported


def block_fp8(w: torch.Tensor) -> quant.QuantizedWeight:
    """w in float8_e4m3fn with one scale per 128x128 block (Qwen3-FP8's layout)."""
    out, inp = w.shape
    blocks = w.reshape(out // 128, 128, inp // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out, inp)
    return fp8_weight(codes, scale, "w")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--kv", type=int, default=512, help="k / v projection rows (KV heads x head dim)")
    ap.add_argument("--layers", type=int, default=16, help="layers a step runs (scales the per-layer time)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1", help="activation rows per call, comma-separated")
    args = ap.parse_args()
    h, i = args.hidden, args.intermediate
    shapes = [(h, h), (args.kv, h), (args.kv, h), (h, h), (i, h), (i, h), (h, i)]
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    fp8 = [block_fp8(torch.randn(*s, generator=gen) * 0.02) for s in shapes]
    dense = [w.dequantize(torch.bfloat16) for w in fp8]
    packed = [pack_linear_weight(d) if prepack_supported(cpu, torch.bfloat16) else d for d in dense]
    kept = [quant.QuantLinear(w, torch.bfloat16, cpu) for w in fp8]
    if kept[0].ops is None:
        print("(the project's FP8 kernel is not built here: the kept rows dequantize per call too)")

    def layer(weights, call, inputs) -> float:
        start = time.perf_counter()
        for (_, inp), w in zip(shapes, weights, strict=True):
            call(inputs[inp], w)
        return time.perf_counter() - start

    variants = {"bfloat16, F.linear": (dense, torch.nn.functional.linear),
                "bfloat16, packed (the worker's)": (packed, linear),
                "FP8 kept, the CPU kernel (the worker's)": (kept, lambda x, w: w(x)),
                "FP8, dequantized per call (torch)": (fp8, lambda x, w: torch.nn.functional.linear(
                    x, w.dequantize(torch.bfloat16)))}
    print(f"| rows | weights | one layer ms | x {args.layers} layers s |\n| ---: | --- | ---: | ---: |")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {n: torch.randn(m, n, generator=gen).to(torch.bfloat16) for n in {h, i}}
            for name, (weights, call) in variants.items():
                layer(weights, call, inputs)  # warm-up
                t = statistics.median(layer(weights, call, inputs) for _ in range(args.repeats))
                print(f"| {m} | {name} | {t * 1e3:.1f} | {args.layers * t:.2f} |", flush=True)


if __name__ == "__main__":
    main()
