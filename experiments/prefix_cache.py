"""Prefix caching: a RAG-style workload with caching on versus off, and the overhead at a zero hit rate.

The stack: a private redis-server, one worker process (bundled SmolLM2-135M GGUF unless --model) and, per run, a
fresh scheduler process in its own Redis namespace on that worker (`--enable-prefix-caching` or
`--no-enable-prefix-caching`; one scheduler drives the worker at a time). Each run first sends one short warm-up
request (it loads the scheduler's detokenizer; it shares no block with the workload), then submits every request
of the workload at once from this process (one thread per request, token-id prompts, temperature 0, `ignore_eos`)
and streams them back.

- RAG: N requests sharing one P-token prefix (the "documents"), each with its own Q-token question, M new tokens
  each (issue 5: N=64, P=1024, Q=64, M=32).
- Zero hit rate: N requests with P+Q-token prompts that share nothing (not even a first block), M new tokens:
  what the caching bookkeeping costs when it never helps. Each run first sends an unmeasured wave of N other
  distinct prompts, which leaves the pool (sized for one wave) full of cached blocks: the measured wave then evicts
  one for every block it takes, as a server that never hits does. Runs alternate off/on `--repeats` times.

Client-side metrics: TTFT = submit -> first streamed token; throughput = output tokens / (first submit -> last
stream end). CPU seconds of the worker, scheduler and redis-server over each measured wave are read from /proc;
output tokens per CPU second is the throughput that other load on a shared machine does not move. The hit rate
is `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` from the scheduler's metrics port. Greedy
outputs with caching on must equal caching off (reported as "identical for k/N"). The scheduler-side cost of
caching (hash the prompt's blocks, look them up, register computed blocks) is also timed in process, without a
model, per request.

    .venv/bin/python -m experiments.prefix_cache                                   # issue 5's sizes (long on a CPU)
    .venv/bin/python -m experiments.prefix_cache --num-requests 16 --repeats 3     # scaled down
    .venv/bin/python -m experiments.prefix_cache --skip-zero-hit --json out.json

Results and commands: experiments/PREFIX_CACHE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time

from llmserve import processes
from llmserve.bench.metrics import percentile, summed_metrics

BLOCK_SIZE = 16


def median(xs: list[float]) -> float:
    return percentile(xs, 50)


# ---- workloads ------------------------------------------------------------------------------------------------


def rag_prompts(n: int, prefix_len: int, question_len: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts: one shared prefix + a distinct question each (ids past the special tokens at the vocab start)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(n)]


def distinct_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# ---- processes ------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.workdir = tempfile.mkdtemp(prefix="llmserve-prefix-bench-")
        self.redis: processes.RedisServer | None = None
        self.worker: processes.Proc | None = None
        self.runs = 0

    def start_worker(self, num_blocks: int) -> None:
        """(Re)start the worker with a pool of `num_blocks` (and redis-server on first use)."""
        if self.redis is None:
            self.redis = processes.start_redis(os.path.join(self.workdir, "redis"))
        if self.worker is not None:
            processes.stop(self.worker, timeout=30)
        a = self.args
        argv = ["--block-size", BLOCK_SIZE, "--num-gpu-blocks-override", num_blocks, "--max-model-len",
                a.max_model_len, "--dtype", a.dtype, "--device", a.device, *(["--model", a.model] if a.model else [])]
        t0 = time.perf_counter()
        self.worker = processes.start_worker(argv, log_dir=self.workdir)
        print(f"worker up in {time.perf_counter() - t0:.1f} s: {num_blocks} KV blocks of {BLOCK_SIZE}", flush=True)

    def ledger(self):
        """The current run's Redis ledger (block accounting)."""
        import redis

        from scheduler_svc.ledger.store import RedisLedger

        return RedisLedger(redis.Redis.from_url(self.redis.url), namespace=f"bench-{self.runs}")

    def stop(self) -> None:
        for p in (self.worker, self.redis):
            if p is not None:
                processes.stop(p, timeout=15)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def scheduler(self, caching: bool) -> tuple[processes.Proc, str, int]:
        """A fresh scheduler process (own namespace) on the worker, SERVING; returns it, its address and its metrics
        port."""
        self.runs += 1
        mport = processes.free_port()
        argv = ["--metrics-port", mport, "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
        if self.args.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", self.args.max_num_batched_tokens]
        if self.args.max_num_seqs:
            argv += ["--max-num-seqs", self.args.max_num_seqs]
        proc = processes.start_scheduler(self.redis.url, self.worker, argv, namespace=f"bench-{self.runs}",
                                     log_dir=self.workdir)
        processes.wait_healthy(proc.address, timeout=120, proc=proc)
        return proc, proc.address, mport


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- one run ----------------------------------------------------------------------------------------------


def stream_all(address: str, prompts: list[list[int]], max_tokens: int, tag: str) -> list[dict]:
    """Submit every prompt at once and stream them back; per request: submit, first token, end."""
    from common.client import Client
    from protos import llmserve_pb2 as pb

    async def one(client: Client, i: int) -> dict:
        req = pb.GenerateRequest(request_id=f"{tag}-{i}", token_ids=pb.TokenIds(ids=prompts[i]),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        r = {"submit": time.perf_counter(), "tokens": []}
        async for msg in client.generate(req):
            if msg.token_ids and "first" not in r:
                r["first"] = time.perf_counter()
            r["tokens"] += msg.token_ids
            r["finish"] = msg.finish_reason or r.get("finish", "")
        r["end"] = time.perf_counter()
        return r

    async def run() -> list[dict]:
        async with Client(address) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(len(prompts)))))

    return asyncio.run(run())


def run(bench: Bench, caching: bool, prompts: list[list[int]], max_tokens: int, label: str,
        fill: list[list[int]] | None = None) -> dict:
    proc, address, mport = bench.scheduler(caching)
    try:
        stream_all(address, [[1000 + i for i in range(5)]], 2, f"warm-{bench.runs}")  # detokenizer load, first step
        if fill:
            # Unmeasured: leave the pool full of cached (evictable) blocks, so the measured requests must evict.
            stream_all(address, fill, max_tokens, f"fill-{bench.runs}")
        ledger = bench.ledger()
        cached_before = ledger.check_ledger()["evictable"]
        before = summed_metrics(mport)
        pids = {"scheduler": proc.pid, "redis": bench.redis.pid, "worker": bench.worker.pid}
        cpu0 = {k: cpu_s(pid) for k, pid in pids.items()}
        t0 = time.perf_counter()
        res = stream_all(address, prompts, max_tokens, f"{label}-{bench.runs}")
        wall = time.perf_counter() - t0
        cpu = {k: cpu_s(pid) - cpu0[k] for k, pid in pids.items()}
        after = summed_metrics(mport)
        cached_after = ledger.check_ledger()["evictable"]
    finally:
        processes.stop(proc, timeout=30)
    bad = [r for r in res if r.get("finish") != "length" or len(r["tokens"]) != max_tokens]
    if bad:
        raise SystemExit(f"{label}: {len(bad)} requests did not finish with {max_tokens} tokens")
    first_submit = min(r["submit"] for r in res)
    ttft = [r["first"] - r["submit"] for r in res]
    out_tokens = sum(len(r["tokens"]) for r in res)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    row = {
        "workload": label, "caching": caching, "requests": len(prompts), "wall_s": wall,
        "ttft_p50_s": median(ttft), "ttft_p95_s": percentile(ttft, 95),
        "output_tok_s": out_tokens / (max(r["end"] for r in res) - first_submit),
        "prefill_tokens": delta("vllm:prompt_tokens_total"), "hit_tokens": hits, "query_tokens": queries,
        "hit_rate": hits / queries if queries else 0.0, "preemptions": delta("vllm:num_preemptions_total"),
        "cached_blocks_before": cached_before, "cached_blocks_after": cached_after, "cpu_s": cpu,
        "tok_per_cpu_s": out_tokens / sum(cpu.values()), "outputs": [r["tokens"] for r in res],
    }
    print(f"  {label:<9} caching {'on ' if caching else 'off'}: TTFT p50 {row['ttft_p50_s']:7.2f} s  p95 "
          f"{row['ttft_p95_s']:7.2f} s  {row['output_tok_s']:7.1f} out tok/s  prefill {row['prefill_tokens']:7.0f} "
          f"tok  hit rate {row['hit_rate']:5.1%}  preemptions {row['preemptions']:.0f}  cached blocks "
          f"{cached_before} -> {cached_after}  ({wall:.1f} s; CPU s: "
          f"scheduler {cpu['scheduler']:.1f}, redis {cpu['redis']:.2f}, worker {cpu['worker']:.0f})", flush=True)
    return row


# ---- scheduler-side cost, in process ------------------------------------------------------------------------


def bookkeeping_cost(prompt_len: int, max_tokens: int, hit: bool, reps: int = 100, rounds: int = 5) -> float:
    """The best of `rounds` averages (a shared machine's noise only ever adds time)."""
    return min(_bookkeeping_cost(prompt_len, max_tokens, hit, reps) for _ in range(rounds))


def _bookkeeping_cost(prompt_len: int, max_tokens: int, hit: bool, reps: int) -> float:
    """Microseconds the caching path adds per request in the scheduler: hash the full blocks, look the prefix up,
    register each computed block (what admission and `_register_computed_blocks` do), without any model."""
    from protos import worker_pb2 as wpb
    from scheduler_svc.core.block_pool import BlockPool
    from scheduler_svc.core.request import Request

    rng = random.Random(1)
    ids = [rng.randrange(100, 49000) for _ in range(prompt_len)]
    nb = -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    pool = BlockPool(nb * 4)
    t_total = 0.0
    for i in range(reps):
        prompt = ids if hit else [rng.randrange(100, 49000) for _ in range(prompt_len)]
        req = Request(f"r{i}", prompt, wpb.SamplingParams(max_tokens=max_tokens))
        t0 = time.perf_counter()
        hashes = req.full_block_hashes(BLOCK_SIZE)[: (prompt_len - 1) // BLOCK_SIZE]
        toks = req.all_token_ids
        hits = pool.cached_prefix(hashes, (tuple(toks[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE])
                                           for j in range(len(hashes))))
        pool.take(hits)
        blocks = hits + pool.allocate(nb - len(hits))
        req.output_ids = list(range(max_tokens))  # register as the tokens come, like the engine
        full = req.full_block_hashes(BLOCK_SIZE)
        toks = req.all_token_ids
        for j in range(len(hits), min(len(full), len(blocks))):
            pool.register(blocks[j], full[j], tuple(toks[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]))
        pool.release(blocks)
        pool.take_changes()
        t_total += time.perf_counter() - t0
    return t_total / reps * 1e6


# ---- main ---------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--zero-hit-requests", type=int, default=None, help="default: --num-requests")
    p.add_argument("--repeats", type=int, default=1, help="zero-hit runs per mode (alternating off/on)")
    p.add_argument("--skip-zero-hit", action="store_true")
    p.add_argument("--skip-rag", action="store_true")
    p.add_argument("--no-fill", action="store_true", help="zero hit: skip the unmeasured wave that fills the cache")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="scheduler default: 512 on CPU")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes we started (finally below)

    n, plen, qlen, m = args.num_requests, args.prefix_len, args.question_len, args.max_tokens
    nz = args.zero_hit_requests or n
    vocab = 49152
    # Room for every request's own blocks at once (caching off), so neither mode preempts.
    per_request = -(-(plen + qlen + m) // BLOCK_SIZE)
    bench = Bench(args)
    rows: list[dict] = []
    try:
        if not args.skip_rag:
            bench.start_worker(n * per_request + 64)
            print(f"RAG: {n} requests, shared {plen}-token prefix + {qlen}-token question, {m} new tokens", flush=True)
            prompts = rag_prompts(n, plen, qlen, vocab, args.seed)
            off = run(bench, False, prompts, m, "rag")
            on = run(bench, True, prompts, m, "rag")
            rows += [off, on]
            same = sum(a == b for a, b in zip(off["outputs"], on["outputs"], strict=True))
            speedup = on["output_tok_s"] / off["output_tok_s"]
            print(f"  TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower with caching (p95 "
                  f"{off['ttft_p95_s'] / on['ttft_p95_s']:.1f}x), throughput {speedup:.2f}x; "
                  f"greedy outputs identical for {same}/{n}", flush=True)
        if not args.skip_zero_hit:
            bench.start_worker(nz * per_request + 64)  # one wave's worth: the fill wave leaves it all cached
            print(f"zero hit rate: {nz} distinct {plen + qlen}-token prompts, {m} new tokens, {args.repeats} x off/on",
                  flush=True)
            prompts = distinct_prompts(nz, plen + qlen, vocab, args.seed + 1)
            # A first wave of other distinct prompts fills the pool, so with caching on the measured wave evicts a
            # cached block for every block it allocates (the steady state of a server that never hits).
            fill = None if args.no_fill else distinct_prompts(nz, plen + qlen, vocab, args.seed + 2)
            zero = {False: [], True: []}
            for r in range(args.repeats):
                for caching in ((False, True) if r % 2 == 0 else (True, False)):
                    row = run(bench, caching, prompts, m, "zero-hit", fill)
                    zero[caching].append(row)
                    rows.append(row)
            t_off = median([r["output_tok_s"] for r in zero[False]])
            t_on = median([r["output_tok_s"] for r in zero[True]])
            same = sum(a == b for a, b in zip(zero[False][0]["outputs"], zero[True][0]["outputs"], strict=True))
            c_off = median([r["cpu_s"]["scheduler"] + r["cpu_s"]["redis"] for r in zero[False]])
            c_on = median([r["cpu_s"]["scheduler"] + r["cpu_s"]["redis"] for r in zero[True]])
            k_off = median([r["tok_per_cpu_s"] for r in zero[False]])
            k_on = median([r["tok_per_cpu_s"] for r in zero[True]])
            print(f"  median scheduler + redis CPU: off {c_off:.2f} s, on {c_on:.2f} s per run; output tokens per CPU "
                  f"second (worker + scheduler + redis): off {k_off:.3f}, on {k_on:.3f}: on/off = {k_on / k_off:.3f}",
                  flush=True)
            print(f"  median throughput off {t_off:.1f}, on {t_on:.1f} out tok/s: on/off = {t_on / t_off:.3f}; "
                  f"hit rate on {median([r['hit_rate'] for r in zero[True]]):.1%}; greedy outputs identical for "
                  f"{same}/{nz}", flush=True)
    finally:
        bench.stop()
    cost_miss = bookkeeping_cost(plen + qlen, m, hit=False)
    cost_hit = bookkeeping_cost(plen + qlen, m, hit=True)
    print(f"scheduler-side caching bookkeeping per {plen + qlen}-token request (hash, look up, register, in "
          f"process): {cost_miss:.0f} us on a miss, {cost_hit:.0f} us on a hit", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
                       "bookkeeping_us": {"miss": cost_miss, "hit": cost_hit}}, f, indent=1)


if __name__ == "__main__":
    main()
