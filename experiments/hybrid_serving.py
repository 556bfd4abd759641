"""Hybrid models served: how many long sequences fit beside a full-attention model of the same size, and the TTFT
of a repeated and of an extended prompt with prefix caching (state snapshots) on and off.

Two random-weight checkpoints written by transformers here, same hidden size, layer count, heads and vocab: a
Qwen3.5 (Gated DeltaNet layers, every 4th layer full attention) and a Qwen3 (every layer full attention).

- Capacity: a real `llmserve worker` per model with the same `--kv-cache-memory` budget; its Describe
  (num_blocks, kv_bytes_per_block, num_state_slots, state_bytes_per_slot) says how many sequences of `--context`
  tokens fit: the blocks they need, and for the hybrid a state slot each. The hybrid is sized twice: the auto slot
  count (the CPU default --max-num-seqs 64 plus room for the snapshot share: 128) and `--num-state-slots` set to
  what the budget holds for that context (one slot plus its blocks per sequence), each read back from the worker.
- TTFT: redis-server + the hybrid worker + one scheduler process per mode (`--enable-prefix-caching` /
  `--no-enable-prefix-caching`). Per repetition a fresh `--prompt-len`-token prompt: sent cold (its answer of
  `--answer-len` tokens kept), sent again (repeat), then extended (prompt + answer + a `--turn-len`-token user
  turn). TTFT = Generate sent -> first streamed token over gRPC; medians; prefix-cache hit tokens from the
  scheduler's `vllm:prefix_cache_hits_total` around each request.

    PYTHONPATH=$PWD .venv/bin/python -m experiments.hybrid_serving
    PYTHONPATH=$PWD .venv/bin/python -m experiments.hybrid_serving --layers 4 --hidden 128 --context 4096 \
        --kv-budget-mib 64 --prompt-len 40 --answer-len 10 --turn-len 9 --reps 1 --json out.json   # smoke size
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import torch
import transformers

from llmserve import processes
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import worker_pb2, worker_pb2_grpc
from tests.e2e.test_model_families_served import word_tokenizer
from tests.e2e.test_prefix_cache import metrics

BLOCK = 16
VOCAB = 8192
HITS = "vllm:prefix_cache_hits_total"


def write_checkpoint(family: str, path: Path, layers: int, hidden: int, max_len: int,
                     attention_every: int = 4) -> None:
    """A random-weight checkpoint and a word-per-id tokenizer (the scheduler loads the directory's tokenizer); the
    hybrid's every `attention_every`-th layer is full attention (Qwen3.5's own pattern is 4)."""
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_len)
    torch.manual_seed(0)
    if family == "qwen3_5":
        types = ["full_attention" if (i + 1) % attention_every == 0 else "linear_attention" for i in range(layers)]
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **common, layer_types=types, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model.eval().save_pretrained(path, safe_serialization=True)
    word_tokenizer(path, VOCAB)


def describe(path: Path, args, extra=()) -> worker_pb2.WorkerInfo:
    """A real worker's sizing: start it, ask Describe, stop it."""
    worker = processes.start_worker(["--model", str(path), "--dtype", "float32", "--kv-cache-memory",
                                     args.kv_budget_mib << 20, "--max-model-len", args.context, *extra])
    try:
        with grpc.insecure_channel(worker.address) as channel:
            return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=60)
    finally:
        processes.stop(worker)


def fits(info: worker_pb2.WorkerInfo, context: int) -> int:
    """Sequences of `context` tokens the worker can hold at once: blocks each, and a state slot each if hybrid."""
    by_blocks = info.num_blocks // math.ceil(context / info.block_size)
    return min(by_blocks, info.num_state_slots) if info.num_state_slots else by_blocks


def capacity(dirs: dict[str, Path], args) -> list[tuple[str, worker_pb2.WorkerInfo, int]]:
    rows = [("qwen3 (full attention)", describe(dirs["qwen3"], args)),
            ("qwen3_5 hybrid, auto slots", describe(dirs["qwen3_5"], args))]
    hybrid = rows[1][1]
    per_seq = math.ceil(args.context / BLOCK) * hybrid.kv_bytes_per_block + hybrid.state_bytes_per_slot
    slots = (args.kv_budget_mib << 20) // per_seq  # what the budget holds: one slot and its blocks per sequence
    rows.append((f"qwen3_5 hybrid, --num-state-slots {slots}",
                 describe(dirs["qwen3_5"], args, ["--num-state-slots", slots])))
    return [(name, info, fits(info, args.context)) for name, info in rows]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(address: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first streamed token, and the whole greedy output."""
    req = pb.GenerateRequest(request_id=uuid.uuid4().hex[:8],
                             sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
    req.token_ids.SetInParent()
    req.token_ids.ids.extend(ids)
    first, out = None, []
    with grpc.insecure_channel(address) as channel:
        start = time.perf_counter()
        for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=600):
            if msg.token_ids and first is None:
                first = time.perf_counter() - start
            out.extend(msg.token_ids)
    return first, out


def ttft_runs(redis_url: str, worker: processes.Proc, caching: bool, args) -> dict[str, list[tuple[float, int]]]:
    """{case: [(ttft seconds, hit tokens)]} for cold / repeat / extended, one scheduler with caching on or off."""
    port = processes.free_port()
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    sched = processes.start_scheduler(redis_url, worker, [flag, "--metrics-port", port],
                                      namespace=processes.new_namespace("hybrid-ttft"))
    runs: dict[str, list[tuple[float, int]]] = {"cold": [], "repeat": [], "extended": []}
    try:
        processes.wait_healthy(sched.address, timeout=180, proc=sched)
        ttft(sched.address, prompt(8, 999), 2)  # warm-up: loads the detokenizer, shares no block with the runs

        def measured(case: str, ids: list[int], max_tokens: int) -> list[int]:
            before = metrics(port).get(HITS, 0)
            seconds, out = ttft(sched.address, ids, max_tokens)
            runs[case].append((seconds, int(metrics(port).get(HITS, 0) - before)))
            return out

        for rep in range(args.reps):
            p = prompt(args.prompt_len, 1000 * rep + caching)
            answer = measured("cold", p, args.answer_len)
            measured("repeat", p, 4)
            measured("extended", p + answer + prompt(args.turn_len, 500 + 1000 * rep + caching), 4)
    finally:
        processes.stop(sched)
    return runs


def serve_ttft(path: Path, tmp: Path, args) -> dict[bool, dict[str, list[tuple[float, int]]]]:
    """redis-server and the hybrid worker, then a scheduler with caching on, then one with it off."""
    redis = processes.start_redis(str(tmp / "redis"))
    worker = processes.start_worker(["--model", str(path), "--dtype", "float32", "--kv-cache-memory", 256 << 20,
                                     "--max-model-len", 4096])
    try:
        return {caching: ttft_runs(redis.url, worker, caching, args) for caching in (True, False)}
    finally:
        processes.stop(worker)
        processes.stop(redis)


def print_capacity(rows, args) -> None:
    full = rows[0][2]
    print(f"\nCapacity: --kv-cache-memory {args.kv_budget_mib} MiB, float32, sequences of {args.context} tokens "
          f"({math.ceil(args.context / BLOCK)} blocks of {BLOCK}); the hybrid has "
          f"{args.layers // args.attention_every} attention layers of {args.layers}\n")
    print("| model | num_blocks | kv_bytes_per_block | num_state_slots | state_bytes_per_slot | sequences that fit "
          "| vs full attention |")
    print("|---|---|---|---|---|---|---|")
    for name, info, n in rows:
        ratio = f"{n / full:.2f}x" if full else "n/a (0 fit)"
        print(f"| {name} | {info.num_blocks} | {info.kv_bytes_per_block} | {info.num_state_slots} | "
              f"{info.state_bytes_per_slot} | {n} | {ratio} |")


def print_ttft(results: dict[bool, dict[str, list[tuple[float, int]]]], args) -> None:
    print(f"\nTTFT: prompt {args.prompt_len} tokens, answer {args.answer_len}, next turn +{args.turn_len}; "
          f"medians of {args.reps} (ms); hit tokens per request\n")
    print("| prefix caching | cold | repeat | extended | repeat hits | extended hits | cold / repeat | "
          "cold / extended |")
    print("|---|---|---|---|---|---|---|---|")
    med = {caching: {case: statistics.median(s for s, _ in r) * 1000 for case, r in runs.items()}
           for caching, runs in results.items()}
    for caching, runs in results.items():
        m = med[caching]
        hits = {case: "/".join(str(h) for _, h in r) for case, r in runs.items()}
        print(f"| {'on' if caching else 'off'} | {m['cold']:.0f} | {m['repeat']:.0f} | {m['extended']:.0f} | "
              f"{hits['repeat']} | {hits['extended']} | {m['cold'] / m['repeat']:.2f}x | "
              f"{m['cold'] / m['extended']:.2f}x |")
    print(f"\nCaching off / on, same request: repeat {med[False]['repeat'] / med[True]['repeat']:.2f}x, "
          f"extended {med[False]['extended'] / med[True]['extended']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--attention-every", type=int, default=4,
                   help="the hybrid's every N-th layer is full attention (4: Qwen3.5's pattern; 10 with --layers 10: "
                   "one attention layer in ten)")
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence for the capacity count")
    p.add_argument("--kv-budget-mib", type=int, default=1024, help="--kv-cache-memory of every worker (MiB)")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--turn-len", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not 1 <= args.attention_every <= args.layers:
        raise SystemExit(f"--attention-every must be in 1..--layers ({args.layers}), got {args.attention_every}")

    with tempfile.TemporaryDirectory(prefix="hybrid-serving-") as tmp:
        dirs = {family: Path(tmp) / family for family in ("qwen3_5", "qwen3")}
        for family, path in dirs.items():
            write_checkpoint(family, path, args.layers, args.hidden, args.context, args.attention_every)
        rows = capacity(dirs, args)
        print_capacity(rows, args)
        results: dict[bool, dict[str, list[tuple[float, int]]]] = {}
        if not args.skip_ttft:
            results = serve_ttft(dirs["qwen3_5"], Path(tmp), args)
            print_ttft(results, args)
    if args.json:
        sizing = ("num_blocks", "kv_bytes_per_block", "num_state_slots", "state_bytes_per_slot")
        out = {"args": vars(args),
               "capacity": [{"model": name, "fit": n, **{k: getattr(info, k) for k in sizing}}
                            for name, info, n in rows],
               "ttft": [{"caching": caching, "case": case, "ttft_s": t, "hit_tokens": h}
                        for caching, runs in results.items() for case, r in runs.items() for t, h in r]}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
