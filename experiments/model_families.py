"""Forward tokens/s of each registered dense family against transformers, same process, same dtype.

One decode step of `batch` sequences, each with `context` cached tokens: ours is the registry's class over a paged
KV cache (the torch attention backend, the CPU production path); transformers' is its model over a DynamicCache
filled by a prefill of the same prompts. Random weights, one shape for every family (hidden 512, 8 layers, 8 query
and 2 KV heads of 64, vocab 8192; the Gemma families' windows 128, so at --context 256 half their layers slide).
The table shows medians of decode tokens/s and the ratio (transformers' time / ours).

    .venv/bin/python -m experiments.model_families --batch-sizes 1,32 --context 256 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch
import transformers

import kernels
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir

BLOCK_SIZE = 16
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=128)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=128, query_pre_attn_scalar=64)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(sliding_window=128, query_pre_attn_scalar=64, sliding_window_pattern=2)),
}


def build(name: str, dtype: torch.dtype, path: str):
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SHAPE, **extra)).eval()
    hf.save_pretrained(path, safe_serialization=True)
    config, weights = load_hf_dir(path)
    ours = models.by_name(config.architecture)(config, weights, dtype, "cpu")
    return hf.to(dtype), ours


def ours_step(model, batch: int, context: int, dtype: torch.dtype):
    """A closure running one decode step of `batch` sequences after `context` cached tokens (cache filled once)."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    kv = torch.zeros(model.kv_cache_shape(batch * blocks, BLOCK_SIZE), dtype=dtype)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, context + 1))
    meta = kernels.build_attention_metadata([context] * batch, [context] * batch, tables, BLOCK_SIZE, "cpu")
    model.forward(ids[:, :context].reshape(-1), torch.arange(context).repeat(batch), kv, meta,
                  torch.arange(batch) * context + context - 1)
    positions = torch.full((batch,), context)

    def step():
        m = kernels.build_attention_metadata([1] * batch, [context + 1] * batch, tables, BLOCK_SIZE, "cpu")
        model.forward(ids[:, context], positions, kv, m, torch.arange(batch))
    return step


def hf_step(model, batch: int, context: int):
    """The same for transformers; its cache grows by one token a step (a few tokens over `context` in all)."""
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, context + 1))
    with torch.no_grad():
        cache = model(ids[:, :context], use_cache=True).past_key_values

    def step():
        with torch.no_grad():
            model(ids[:, context:], past_key_values=cache, use_cache=True)
    return step


def median_seconds(fns, reps: int) -> list[float]:
    """Median seconds of each function, timed alternately (a shared machine's load hits both alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"decode tokens/s, context {args.context}, {args.dtype}, {args.threads} threads, median of {args.reps}")
    print(f"{'family':8} {'batch':>5} {'ours':>9} {'transformers':>12} {'ratio':>6}")
    rows = []
    for name in args.families.split(","):
        with tempfile.TemporaryDirectory() as path:
            hf, ours = build(name, dtype, path)
            for batch in map(int, args.batch_sizes.split(",")):
                mine = ours_step(ours, batch, args.context, dtype)
                theirs = hf_step(hf, batch, args.context)
                mine(), theirs()  # warm-up
                t_ours, t_hf = median_seconds([mine, theirs], args.reps)
                print(f"{name:8} {batch:5d} {batch / t_ours:9.1f} {batch / t_hf:12.1f} {t_hf / t_ours:6.2f}x",
                      flush=True)
                rows.append({"family": name, "batch": batch, "ours_tokens_per_s": batch / t_ours,
                             "transformers_tokens_per_s": batch / t_hf})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
