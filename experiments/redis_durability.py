"""What `--redis-durability` costs per step: tokens/s and Redis commit latency at N concurrent streams, for each mode,
side by side in one run on the same processes.

Real processes: a Redis primary (`appendonly yes`, `appendfsync always`: what `local` needs on Redis 7.0) and one
replica, both redis-server on loopback; one worker serving a 2-layer random-weight Llama (so the model costs little
and the commit is a visible share of a step); and, per (mode, N), a fresh in-process scheduler in its own namespace
with `--redis-durability MODE`. N greedy streams of --max-tokens tokens each come from a separate client process
(experiments/scheduler_overhead.py's). Reported per run: output tokens/s from the first submit to the last end,
and the commit time of every step (the commit script plus the durability wait, one round trip:
`StepTimes.commit`), p50 and p99.
Runs alternate modes within each repeat so that load drifting on a shared machine hits every mode alike.

    .venv/bin/python -m experiments.redis_durability                          # N = 16 and 256, 2 repeats
    .venv/bin/python -m experiments.redis_durability --running 16 --repeats 1 --max-tokens 32   # smoke

Two groups run side by side: one whose primary has Redis's default `appendfsync everysec`, one with `appendfsync
always` (which `local` requires before Redis 7.2). Rows are labelled "MODE, FSYNC": on the `always` primary every
mode pays the fsync, which the primary does before answering whatever the scheduler waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import redis

from experiments.scheduler_overhead import finish_clients, make_tiny_llama, start_clients
from llmserve.bench.metrics import percentile
from llmserve.processes import start_redis, start_worker, stop
from tests.support.stack import start_scheduler_in_process

# (label, durability flag, which primary)
MODES = [("none, everysec", "none", "everysec"), ("replica, everysec", "replica", "everysec"),
         ("none, always", "none", "always"), ("local, always", "local", "always"),
         ("replica, always", "replica", "always")]


def primary_with_replica(root: str, fsync: str) -> tuple:
    primary = start_redis(os.path.join(root, f"primary-{fsync}"), appendonly=True,
                          extra_args=["--appendfsync", fsync])
    replica = start_redis(os.path.join(root, f"replica-{fsync}"), appendonly=True,
                          extra_args=["--replicaof", "127.0.0.1", primary.port])
    link = redis.Redis(port=replica.port)
    deadline = time.monotonic() + 30
    while link.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not sync")
        time.sleep(0.1)
    return primary, replica


def run_one(url: str, worker, mode: str, n: int, args, workdir: str, tag: str) -> dict:
    sched = start_scheduler_in_process(url, worker, [
        "--redis-durability", mode, "--namespace", f"dur-{tag}", "--max-num-seqs", "256",
        "--max-num-batched-tokens", "4096"])
    try:
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(8)] for i in range(n)]
        proc, out = start_clients(f"127.0.0.1:{sched.port}", prompts, args.max_tokens, tag, workdir)
        results = finish_clients(proc, out, timeout=1800)
        wall = max(r["end"] for r in results) - min(r["submit"] for r in results)  # the client's clock
        tokens = sum(len(r["token_ids"]) for r in results)
        commits = [s.commit for s in sched.driver.step_stats]
        return {"mode": mode, "n": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                "commit_p50_ms": 1000 * percentile(commits, 50), "commit_p99_ms": 1000 * percentile(commits, 99),
                "steps": len(commits)}
    finally:
        sched.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[16, 256])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="durability-")
    model = make_tiny_llama(os.path.join(workdir, "model"))
    procs = [*primary_with_replica(workdir, "everysec"), *primary_with_replica(workdir, "always")]
    urls = {"everysec": procs[0].url, "always": procs[2].url}
    worker = start_worker(["--model", model, "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override",
                           "4096", "--max-model-len", "512"], cwd=os.path.dirname(os.path.dirname(__file__)))
    rows: list[dict] = []
    try:
        for rep in range(args.repeats):
            for n in args.running:
                for label, mode, fsync in MODES:
                    row = run_one(urls[fsync], worker, mode, n, args, workdir, f"{rep}-{n}-{mode}-{fsync}")
                    row["label"] = label
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        stop(worker)
        for proc in procs:
            stop(proc)
    print("\n| streams | mode | output tok/s | commit p50 ms | commit p99 ms |\n| ---: | --- | ---: | ---: | ---: |")
    for n in args.running:
        for label, _, _ in MODES:
            runs = [r for r in rows if r["n"] == n and r["label"] == label]
            print(f"| {n} | {label} | {statistics.median(r['tok_s'] for r in runs):.0f} | "
                  f"{statistics.median(r['commit_p50_ms'] for r in runs):.2f} | "
                  f"{statistics.median(r['commit_p99_ms'] for r in runs):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
