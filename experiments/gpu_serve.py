"""Serving throughput of a 1B-class Llama with random weights (Llama-3.2-1B's shape: 16 layers, hidden 2048, 32/8
heads of 64, MLP 8192, vocab 128256, tied head) at fixed concurrencies, through `llmserve serve` and the bench load
generator (gRPC, greedy, `ignore_eos`, all requests offered at once, at most B in flight).

    python -m experiments.gpu_serve --json results.json             # CUDA, bfloat16, batch 1, 16, 64, 256
    python -m experiments.gpu_serve --smoke                         # a 2-layer toy on CPU: the same path in seconds

The weights are drawn on the device and written as one safetensors file (no model hub here); the tokenizer is a
word list as large as the vocabulary, so every id the random model emits detokenizes. Cached in --model-dir."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

LLAMA_1B = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "tie_word_embeddings": True}
SMOKE = {"vocab_size": 32768, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
         "rope_theta": 10000.0, "tie_word_embeddings": True}


def write_random_llama(path: str, shape: dict, dtype: str, device: str, seed: int = 0) -> str:
    """config.json + model.safetensors + tokenizer.json; weights N(0, 0.02), norms near 1 (activations stay in
    range over 16 layers). Skipped when `path` already holds them."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from experiments.scheduler_overhead import save_word_tokenizer

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    config = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, dtype=dtype,
                                      architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        names = {n: p.shape for n, p in transformers.LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape_ in names.items():
        t = torch.randn(shape_, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.05 * t if "norm" in name else 0.02 * t
        tensors[name] = t.to(getattr(torch, dtype)).cpu().contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    save_word_tokenizer(path, shape["vocab_size"])
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64,256", help="requests in flight, comma-separated")
    p.add_argument("--prompts-per-batch", type=int, default=2, help="requests per run = this x batch (at least 8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llmserve-llama1b-random"))
    p.add_argument("--server-args", default="", help="more `llmserve serve` flags, one string")
    p.add_argument("--smoke", action="store_true", help="a 2-layer toy on CPU, float32, batch 1 and 2, 4 requests")
    p.add_argument("--json", default=None, help="write the per-batch records here")
    args = p.parse_args(argv)

    import shlex

    from llmserve.bench import workloads
    from llmserve.bench.runner import LocalServer, RunSettings, Target, run

    shape = LLAMA_1B
    if args.smoke:
        shape, args.device, args.dtype, args.batch_sizes = SMOKE, "cpu", "float32", "1,2"
        args.model_dir, args.output_len, args.prompt_len = args.model_dir + "-smoke", 8, 16
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        p.error(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    t0 = time.monotonic()
    write_random_llama(args.model_dir, shape, args.dtype, args.device)
    print(f"[gpu_serve] model {args.model_dir} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    extra = ["--model", args.model_dir, "--dtype", args.dtype, "--device", args.device,
             "--max-num-seqs", str(max(batches)), *shlex.split(args.server_args)]
    log = os.path.join(tempfile.gettempdir(), "llmserve-gpu-serve.log")
    records, t0 = [], time.monotonic()
    with LocalServer("chunked", 2048, extra, log) as server:
        print(f"[gpu_serve] server ready in {time.monotonic() - t0:.0f} s (log {log})", file=sys.stderr, flush=True)
        for b in batches:
            n = 4 if args.smoke else max(8, args.prompts_per_batch * b)
            params = workloads.WorkloadParams(num_requests=n, seed=0, prompt_len=(args.prompt_len, args.prompt_len),
                                              output_len=(args.output_len, args.output_len))
            target = Target(backend="llmserve", mode="chunked", address=server.address,
                            metrics_url=server.metrics_url, pid=server.proc.pid, server_argv=server.argv,
                            server_flags=server.flags)
            record = run(target, RunSettings(workload="chat", params=params, max_concurrency=b, progress=False))
            record["batch"] = b
            records.append(record)
            print(f"[gpu_serve] batch {b}: {record['completed']}/{n} completed, "
                  f"{record['output_throughput'] or 0:.1f} output tok/s", file=sys.stderr, flush=True)
    lines = ["| batch | requests | completed | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | peak KV |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        kv = r["peak_kv_usage"]
        lines.append(f"| {r['batch']} | {r['num_requests']} | {r['completed']} | {r['output_throughput'] or 0:.1f} | "
                     f"{r['ttft_ms']['p50'] or 0:.1f} | {r['tpot_ms']['p50'] or 0:.2f} | {r['itl_ms']['p50'] or 0:.2f}"
                     f" | {'-' if kv is None else f'{100 * kv:.0f}%'} |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_shape": shape, "dtype": args.dtype, "device": args.device, "table": lines,
                       "runs": records}, f, indent=1, default=str)
    return 0 if all(r["completed"] == r["num_requests"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
