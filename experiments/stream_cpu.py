"""CPU time per output token of each process of a real stack while it streams: the HTTP API, the scheduler and the
worker, at a few concurrencies.

Launches `llmserve serve` (redis-server, worker, scheduler in the serve process, API) on free ports with the bundled
model, then for each concurrency runs the load generator (`llmserve/bench/loadgen.py`) through the OpenAI API
(`--transport http`, streamed /v1/completions as `vllm bench serve` sends them) or straight to the scheduler over
gRPC (`--transport grpc`), and reads each process's user + system CPU seconds (`/proc/<pid>/stat` via psutil)
before and after the timed run. CPU time, not wall time, is the figure: the machine is shared, so wall-clock
speed moves with other people's work while a process's own CPU seconds per token stay put.

    .venv/bin/python -m experiments.stream_cpu                               # concurrency 16 and 64, HTTP
    .venv/bin/python -m experiments.stream_cpu --concurrency 64 --transport grpc
    .venv/bin/python -m experiments.stream_cpu --concurrency 2 --num-requests 4 --output-len 8   # smoke

The scheduler process is `serve` itself (driver thread, the gRPC event loop, every stream's detokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time

import httpx
import psutil

from llmserve.bench import loadgen, workloads
from llmserve.bench.runner import LocalServer


def stack_pids(server: LocalServer) -> dict[str, int]:
    """process role -> pid: the serve process runs the scheduler; its children the worker and the API."""
    pids = {"scheduler": server.proc.pid}
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            role = child.cmdline()[3:4]  # python -m llmserve.cli ROLE ...
            if role and role[0] in ("api", "worker"):
                pids[role[0]] = child.pid
    return pids


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for role, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[role] = t.user + t.system
    out["client"] = sum(os.times()[:2])
    return out


async def settle(http_url: str, pids: dict[str, int], quiet: float = 0.05, timeout: float = 120.0) -> dict[str, float]:
    """Wait until the stack is idle (each API and scheduler loads its tokenizer in the background after start-up:
    seconds of CPU that must not land in the first run); returns each process's idle CPU share over the last second."""
    async with httpx.AsyncClient(base_url=http_url, timeout=timeout) as client:
        await client.post("/tokenize", json={"prompt": "hello"})  # answers once the API's tokenizer is loaded
    deadline = time.monotonic() + timeout
    while True:
        a = cpu_seconds(pids)
        await asyncio.sleep(1.0)
        b = cpu_seconds(pids)
        idle = {r: b[r] - a[r] for r in pids}
        if max(idle.values()) < quiet or time.monotonic() > deadline:
            return idle


async def measure(transport: loadgen.Transport, specs, concurrency: int, pids: dict[str, int], http_url: str) -> dict:
    await loadgen.warm_up(transport, 2)
    idle = await settle(http_url, pids)
    before = cpu_seconds(pids)
    results, _ = await loadgen.run(transport, specs, max_concurrency=concurrency, progress=False)
    after = cpu_seconds(pids)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    tokens = sum(r.output_tokens for r in results)
    duration = max(r.end_s for r in results)
    row = {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens,
           "tokens_per_s": tokens / duration}
    for role in idle:
        row[f"{role}_idle_cpu_share"] = idle[role]  # CPU seconds per second while idle, just before the run
    for role in after:
        row[f"{role}_cpu_s"] = after[role] - before[role]
        row[f"{role}_us_per_token"] = 1e6 * (after[role] - before[role]) / tokens
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16,64", help="comma-separated concurrencies, one run each")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per run (default: 4 x concurrency)")
    ap.add_argument("--prompt-len", default="32:64", help="LO:HI prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--transport", choices=("http", "grpc"), default="http")
    ap.add_argument("--server-args", default="", help="extra `llmserve serve` flags, one string")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    extra = args.server_args.split() + ["--num-gpu-blocks-override", "2048"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalServer("chunked", 1024, extra, os.path.join(tmp, "serve.log")) as server:
        pids = stack_pids(server)
        for c in (int(x) for x in args.concurrency.split(",")):
            params = workloads.WorkloadParams(num_requests=args.num_requests or 4 * c, prompt_len=(lo, hi),
                                              output_len=(args.output_len, args.output_len), seed=c)
            specs = workloads.generate("chat", params)
            transport = (loadgen.HttpTransport(server.http_url) if args.transport == "http"
                         else loadgen.GrpcTransport(server.address))
            row = asyncio.run(measure(transport, specs, c, pids, server.http_url))
            row["transport"] = args.transport
            rows.append(row)
            print(f"concurrency {c:>3} ({args.transport}): {row['output_tokens']} tokens, "
                  f"{row['tokens_per_s']:.1f} tok/s; CPU us per output token: "
                  + ", ".join(f"{r} {row[f'{r}_us_per_token']:.0f}" for r in ("api", "scheduler", "worker", "client")
                              if f"{r}_us_per_token" in row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
