"""End-to-end greedy throughput: the `llmserve serve` stack vs Hugging Face transformers, same requests, same run.

llmserve: a private redis-server, a worker process and the scheduler (built as `llmserve serve` builds them,
with the same defaults unless a flag below says otherwise) serving the bundled SmolLM2-135M GGUF; all requests
are submitted at once from a separate client process (token-id prompts, temperature 0, `ignore_eos`) and streamed
back. Throughput = output tokens / (first submit -> last stream end), client side; TTFT and ITL are client side
too (a streamed message carrying k tokens counts its gap k times, split evenly).

transformers: the same GGUF loaded by transformers (float32, as our CPU worker runs it), the same prompts generated
one at a time with `generate(do_sample=False, max_new_tokens=M, min_new_tokens=M)` (min = max keeps EOS out, like
`ignore_eos`). With `--hf-requests K < N` only K of them (evenly spaced, so their prompt lengths span the range)
are timed and the wall for all N is extrapolated from the measured output tokens/s (the report says so).

    .venv/bin/python -m experiments.serve_throughput                    # 32 requests, prompts 32-256, 64 new; HF on 8
    .venv/bin/python -m experiments.serve_throughput --hf-requests 32   # HF timed on all 32 (~8 minutes here)
    .venv/bin/python -m experiments.serve_throughput --num-requests 8 --hf-requests 2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from experiments.scheduler_overhead import REPO, Stack, client_latencies, finish_clients, start_clients
from llmserve.bench.metrics import percentile


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic prompts: lengths uniform in [lo, hi], ids drawn past the special tokens at the vocab start."""
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return [[rng.randrange(100, vocab) for _ in range(k)] for k in lengths]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_llmserve(args, model: str, prompts: list[list[int]]) -> dict:
    block_size = 16
    blocks = args.num_gpu_blocks_override or sum(-(-(len(p) + args.max_tokens) // block_size) for p in prompts) + 64
    extra = [] if args.enable_chunked_prefill else ["--no-enable-chunked-prefill"]
    t0 = time.perf_counter()
    with Stack(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               num_blocks=blocks, max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
               block_size=block_size, extra_scheduler_args=extra) as stack:
        startup = time.perf_counter() - t0
        info, pol = stack.driver.worker_info, stack.driver.cfg.policy
        print(f"llmserve up in {startup:.1f} s: {info.model.name} on {info.device} ({info.dtype}), {info.num_blocks} "
              f"KV blocks of {info.block_size}; max_num_seqs {pol.max_num_seqs}, max_num_batched_tokens "
              f"{pol.max_num_batched_tokens}", flush=True)
        # Warm-up: load the scheduler's tokenizer and run the first steps outside the timed window.
        proc, out = start_clients(stack.address, [prompts[0][:16]], 4, f"warm-{os.urandom(3).hex()}", stack.workdir)
        finish_clients(proc, out, timeout=300)
        stack.wait_idle()
        base = len(stack.driver.step_stats)
        # CPU seconds of the three serving processes (the scheduler is this one), to set against transformers'.
        pids = [p.pid for p in stack.procs]  # redis-server, worker
        cpu0 = [proc_cpu_s(pid) for pid in pids] + [time.process_time()]
        proc, out = start_clients(stack.address, prompts, args.max_tokens, f"run-{os.urandom(3).hex()}",
                                  stack.workdir)
        results = finish_clients(proc, out, timeout=3600)
        cpu1 = [proc_cpu_s(pid) for pid in pids] + [time.process_time()]
        stats = list(stack.driver.step_stats)[base:]
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    decode = [s for s in stats if s.tokens == s.running]
    wall = max(r["end"] for r in results) - min(r["submit"] for r in results)
    out_tokens = sum(len(r["token_ids"]) for r in results)
    ttft, itl = client_latencies(results)
    bad = [r for r in results if r["finish"] != "length" or len(r["token_ids"]) != args.max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} llmserve requests did not produce {args.max_tokens} tokens: "
                           f"{[(r['finish'], len(r['token_ids'])) for r in bad[:5]]}")
    return {
        "wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall, "steps": len(stats),
        "tokens_per_cpu_s": out_tokens / sum(cpu),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "worker_s": sum(s.worker for s in stats), "step_wall_s": sum(s.wall for s in stats),
        "cpu_s": sum(cpu), "cpu_redis_s": cpu[0], "cpu_worker_s": cpu[1], "cpu_scheduler_s": cpu[2],
        # Steps whose tokens are one per running request are pure decode; the rest carry prefill chunks.
        "decode_steps": len(decode), "decode_worker_s": sum(s.worker for s in decode),
        "decode_step_worker_p50_ms": percentile([s.worker * 1e3 for s in decode], 50),
        "decode_batch_p50": percentile([s.running for s in decode], 50),
        "prefill_steps": len(stats) - len(decode),
        "prefill_worker_s": sum(s.worker for s in stats) - sum(s.worker for s in decode),
        "outputs": [r["token_ids"] for r in results],
    }


def run_hf(args, model: str, prompts: list[list[int]]) -> dict:
    import torch
    import transformers

    directory, name = os.path.split(model)
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    print(f"transformers model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # An evenly spaced subset, so its prompt lengths span the whole range.
    picked = [round(i * len(prompts) / args.hf_requests) for i in range(args.hf_requests)]
    subset = [prompts[i] for i in picked]
    outputs, per_request = [], []
    with torch.inference_mode():
        # Warm-up (first-call allocations), not timed.
        hf.generate(torch.tensor([prompts[0][:16]]), attention_mask=torch.ones(1, 16, dtype=torch.long),
                    max_new_tokens=4, min_new_tokens=4, do_sample=False)
        start, cpu0 = time.perf_counter(), time.process_time()
        for i, ids in enumerate(subset):
            t = time.perf_counter()
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False)
            per_request.append(time.perf_counter() - t)
            outputs.append(out[0, len(ids):].tolist())
            print(f"  transformers request {i + 1}/{len(subset)}: {len(ids)} prompt tokens, "
                  f"{per_request[-1]:.2f} s", flush=True)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    out_tokens = sum(len(o) for o in outputs)
    rate = out_tokens / wall
    total_tokens = len(prompts) * args.max_tokens
    return {"measured_requests": len(subset), "measured_wall_s": wall, "output_tokens": out_tokens,
            "tokens_per_s": rate, "cpu_s": cpu, "tokens_per_cpu_s": out_tokens / cpu,
            "wall_s_for_all": wall if len(subset) == len(prompts) else total_tokens / rate,
            "extrapolated": len(subset) < len(prompts), "per_request_p50_s": percentile(per_request, 50),
            "outputs": outputs, "picked": picked, "torch_threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--hf-requests", type=int, default=8,
                   help="time transformers on K evenly spaced requests and extrapolate its tokens/s to all of them "
                        "(default 8, to keep a run near 5 minutes on 2 CPU cores; pass --num-requests to time all)")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    # `llmserve serve` defaults unless set: the scheduler sizes these for the worker's device.
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="worker KV blocks (default: just enough for the requests, to keep memory small)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads for the worker and for transformers alike; 0 = torch's own choice. Default 1: "
                        "on a small shared machine multi-threaded torch swings 10x with the load")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    args.hf_requests = min(args.hf_requests, args.num_requests)
    if not 1 <= args.hf_requests <= args.num_requests:
        raise SystemExit("--hf-requests must be in 1..--num-requests")

    from worker_svc.model.loader import default_model_path

    model = args.model or default_model_path()
    import gguf

    vocab = len(gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    print(f"{len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), {args.max_tokens} new tokens each, greedy; torch threads "
          f"{args.torch_threads or 'default'} for the worker and transformers", flush=True)
    os.chdir(REPO)
    if args.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # the worker process reads it at start-up

    ours = run_llmserve(args, model, prompts)
    print(f"llmserve: {ours['output_tokens']} tokens in {ours['wall_s']:.2f} s = {ours['tokens_per_s']:.1f} tok/s; "
          f"TTFT p50 {ours['ttft_p50_s']:.2f} s p99 {ours['ttft_p99_s']:.2f} s; ITL p50 {ours['itl_p50_ms']:.1f} ms "
          f"p99 {ours['itl_p99_ms']:.1f} ms; {ours['steps']} steps, worker busy {ours['worker_s']:.2f} s, step wall "
          f"{ours['step_wall_s']:.2f} s; {ours['prefill_steps']} steps with prefill: worker "
          f"{ours['prefill_worker_s']:.2f} s; "
          f"{ours['decode_steps']} pure decode steps: worker {ours['decode_worker_s']:.2f} s, "
          f"p50 {ours['decode_step_worker_p50_ms']:.0f} ms at batch {ours['decode_batch_p50']:.0f}; CPU "
          f"{ours['cpu_s']:.1f} s (worker {ours['cpu_worker_s']:.1f}, scheduler {ours['cpu_scheduler_s']:.1f}, "
          f"redis {ours['cpu_redis_s']:.2f}) = {ours['tokens_per_cpu_s']:.1f} tokens per CPU-second", flush=True)
    rows = {"llmserve": ours}
    if not args.skip_hf:
        hf = run_hf(args, model, prompts)
        rows["transformers"] = hf
        same = sum(ours["outputs"][i] == o for i, o in zip(hf["picked"], hf["outputs"], strict=True))
        ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
        how = (f"timed on {hf['measured_requests']} of {len(prompts)} requests, wall for all extrapolated"
               if hf["extrapolated"] else "all requests timed")
        print(f"transformers: {hf['output_tokens']} tokens in {hf['measured_wall_s']:.2f} s = "
              f"{hf['tokens_per_s']:.1f} tok/s ({how}); wall for {len(prompts)} requests "
              f"{hf['wall_s_for_all']:.2f} s; CPU {hf['cpu_s']:.1f} s = {hf['tokens_per_cpu_s']:.1f} tokens per "
              "CPU-second", flush=True)
        cpu_ratio = ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
        print(f"\n| stack | requests | output tokens | wall (s) | output tok/s | tok per CPU-s | TTFT p50 (s) | "
              f"TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|\n"
              f"| llmserve | {len(prompts)} concurrent | {ours['output_tokens']} | {ours['wall_s']:.2f} | "
              f"{ours['tokens_per_s']:.1f} | {ours['tokens_per_cpu_s']:.1f} | {ours['ttft_p50_s']:.2f} | "
              f"{ours['ttft_p99_s']:.2f} | {ours['itl_p50_ms']:.1f} | {ours['itl_p99_ms']:.1f} |\n"
              f"| transformers | {hf['measured_requests']} one at a time | {hf['output_tokens']} | "
              f"{hf['wall_s_for_all']:.2f}{' (extrapolated)' if hf['extrapolated'] else ''} | "
              f"{hf['tokens_per_s']:.1f} | {hf['tokens_per_cpu_s']:.1f} | | | | |")
        print(f"\nthroughput ratio llmserve / transformers: {ratio:.2f}x (target >= 5x: "
              f"{'met' if ratio >= 5 else 'MISSED'}); per CPU-second: {cpu_ratio:.2f}x; greedy outputs identical "
              f"for {same} of {hf['measured_requests']} requests")
        rows["cpu_ratio"] = cpu_ratio
        rows["ratio"] = ratio
        rows["identical_outputs"] = same
    if args.json:
        for v in rows.values():
            if isinstance(v, dict):
                v.pop("outputs", None)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
