"""Multi-LoRA cost on the worker: output tokens/s of 16 concurrent greedy streams with 0, 1 and 4 distinct adapters
at rank 8 and 64, against the base model without --enable-lora, all in one run (one process, the bundled model).

Each case runs C streams (prompt P tokens, T output tokens, ignore_eos) through `ModelRunner.execute` as the
scheduler would plan them: one step admits all C (their prompts prefilled whole), then one decode step per token.
Stream i uses adapter i mod A (A = 0: none). Cases alternate and the order rotates each repetition (a shared box is
noisy); the table shows medians of tok/s = C * T / the whole run's seconds and each case's ratio to base-only, and
the same from the process's CPU time (less sensitive to other processes on a shared machine).

    .venv/bin/python -m experiments.lora_throughput                          # ~5-10 min on 2 loaded cores
    .venv/bin/python -m experiments.lora_throughput --ranks 8 --repeats 1 --output-tokens 4 --json /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch
from safetensors.torch import save_file

from protos import worker_pb2 as pb
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.loader import default_model_path
from worker_svc.model.lora import module_shapes
from worker_svc.server import execute_step

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--adapters", default="0,1,4", help="distinct adapters per case, comma-separated")
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.adapters = [int(x) for x in a.adapters.split(",")]
    a.ranks = [int(x) for x in a.ranks.split(",")]
    return a


def write_adapter(path: str, runner: ModelRunner, rank: int, seed: int) -> str:
    """A random PEFT adapter over every projection of every layer."""
    cfg = runner.config
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, (fan_in, fan_out) in module_shapes(cfg).items():
            part = "self_attn" if m in ALL_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": rank, "target_modules": list(ALL_MODULES), "peft_type": "LORA"}, f)
    return path


def run_case(runner: ModelRunner, adapters: list[tuple[str, str]], args: argparse.Namespace,
             prompts) -> tuple[float, float]:
    """Wall and CPU seconds for C streams of T tokens: one admitting step, then T - 1 decode steps."""
    c, t = args.concurrency, args.output_tokens
    per = -(-(args.prompt_tokens + t) // runner.block_size)
    greedy = pb.SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
    step = runner.batch.last_step_id + 1
    new = []
    for i in range(c):
        name, path = adapters[i % len(adapters)] if adapters else ("", "")
        new.append(pb.NewRequest(slot=i, request_id=f"s{step}-{i}", prompt_token_ids=prompts[i], sampling=greedy,
                                 block_ids=list(range(i * per, (i + 1) * per)),
                                 num_scheduled_tokens=args.prompt_tokens, lora_name=name, lora_path=path))
    start, cpu = time.perf_counter(), time.process_time()
    execute_step(runner, pb.StepPlan(step_id=step, new_requests=new))
    for k in range(1, t):
        execute_step(runner, pb.StepPlan(step_id=step + k, cached=pb.CachedRequests(
            slots=range(c), num_scheduled_tokens=[1] * c)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert not len(runner.batch.inputs), "every stream must have finished"
    return seconds, cpu


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    common = dict(model=args.model or default_model_path(), device=args.device, dtype=args.dtype, max_model_len=1024,
                  num_gpu_blocks_override=args.concurrency * (-(-(args.prompt_tokens + args.output_tokens) // 16)))
    runners = {"base": ModelRunner(WorkerConfig(**common))}
    for r in args.ranks:
        runners[f"r{r}"] = ModelRunner(WorkerConfig(**common, enable_lora=True, max_loras=max(args.adapters),
                                                    max_lora_rank=r, max_cpu_loras=max(args.adapters)))
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    paths = {r: [(f"r{r}-{i}", write_adapter(f"{tmp}/r{r}-{i}", runners["base"], r, seed=i))
                 for i in range(max(args.adapters))] for r in args.ranks}
    g = torch.Generator().manual_seed(0)
    vocab = runners["base"].config.vocab_size
    prompts = [torch.randint(10, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.concurrency)]
    cases = [("base-only", "base", [])] + [(f"rank {r}, {a} adapters", f"r{r}", paths[r][:a])
                                           for r in args.ranks for a in args.adapters]
    for _, runner, adapters in cases:  # warm-up: first touches, adapters into the pools
        run_case(runners[runner], adapters, args, prompts)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
    for rep in range(args.repeats):
        k = rep % len(cases)
        for name, runner, adapters in cases[k:] + cases[:k]:
            times[name].append(run_case(runners[runner], adapters, args, prompts))
            print(f"rep {rep} {name}: {times[name][-1][0]:.2f}s wall, {times[name][-1][1]:.2f}s CPU", file=sys.stderr)
    tokens = args.concurrency * args.output_tokens

    def rate(name: str, i: int) -> float:
        return tokens / statistics.median(t[i] for t in times[name])

    rows = []
    print(f"| case (concurrency {args.concurrency}, {args.prompt_tokens}-token prompts, {args.output_tokens} output "
          "tokens) | output tok/s | vs base-only | tok per CPU-s | vs base-only |\n|---|---:|---:|---:|---:|")
    for name, _, _ in cases:
        tps, cps = rate(name, 0), rate(name, 1)
        base_tps, base_cps = rate("base-only", 0), rate("base-only", 1)
        rows.append({"case": name, "tok_s": tps, "ratio": tps / base_tps, "tok_per_cpu_s": cps,
                     "cpu_ratio": cps / base_cps, "seconds": times[name]})
        print(f"| {name} | {tps:.1f} | {tps / base_tps:.3f} | {cps:.1f} | {cps / base_cps:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
