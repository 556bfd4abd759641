"""Chaos and soak: a seeded schedule of faults under a sustained mixed load, then every stream checked against an
undisturbed replay of the same requests.

The stack (experiments/chaos_kit/stack.py): a Redis primary, a replica and three Sentinels; one CPU worker; a leader
and a standby scheduler (`--debug-invariants`) behind a forwarder that sends connections to whichever one is
SERVING; the HTTP API. The load (chaos_kit/load.py): `--concurrency` slots running greedy, seeded, n=2, json_schema
(HTTP), seeded HTTP SSE and cancelled streams. The faults, in an order drawn from `--seed`: kill -9 of the Redis
primary (Sentinel fail-over), SIGSTOP/SIGCONT of the primary for 3 s (a partition), kill -9 of the leading scheduler
(the standby takes over; the killed one comes back as standby), kill -9 of the worker (restarted on its port), and
with `--tensor-parallel-size N` (N >= 2; the bundled SmolLM2's 9 heads need 3) kill -9 of a rank other than 0 (the
group ends; the worker is restarted). Each fault waits until the stack serves again and every stream open then has
had a message since (or ended).

Checked at the end, per durability mode (`--redis-durability` none / local / replica, each on a fresh stack):
  lost      streams that ended with an error (UNKNOWN, a timeout, ...) instead of their tokens;
  changed   StreamDiverged, or tokens that differ from the replay (allowed only without `replica` durability, and
            only where a scheduler logged that a promoted replica was behind);
  leaked    KV blocks, state slots or requests the ledger still holds once idle (RedisLedger.check_ledger);
  health    gRPC health of the service address and HTTP /health sampled every 0.25 s, each within 1 s;
  stall     the longest wait between two messages of one stream (the first message included).
With `--duration-s` the load runs that long (a soak; faults, if any, spread over it) and RSS of every process and
the primary's used_memory are sampled; growth after `--warmup-s` is reported against `--rss-bound-mib` /
`--redis-bound-mib`.

    .venv/bin/python -m experiments.chaos --primary-kills 5 --scheduler-kills 5 --worker-kills 3 --concurrency 16
    .venv/bin/python -m experiments.chaos --primary-kills 20 --scheduler-kills 20 --worker-kills 10 --concurrency 32
    .venv/bin/python -m experiments.chaos --duration-s 1800 --durability replica --skip-replay    # a soak

JSON goes to --json (default experiments/out/chaos-TIMESTAMP.json, not tracked), a Markdown summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict

from experiments.chaos_kit import checks
from experiments.chaos_kit.load import Load, Result
from experiments.chaos_kit.stack import RECOVER_TIMEOUT_S, Stack

MODES = ("none", "local", "replica")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fault_schedule(args) -> list[str]:
    kinds = (["primary-kill"] * args.primary_kills + ["primary-stop"] * args.primary_stops
             + ["scheduler-kill"] * args.scheduler_kills + ["worker-kill"] * args.worker_kills
             + ["tp-rank-kill"] * args.tp_rank_kills)
    random.Random(args.seed).shuffle(kinds)
    return kinds


def run_mode(mode: str, args, root: str) -> dict:
    worker_args = ["--device", "cpu", "--num-gpu-blocks-override", args.num_blocks, "--max-model-len", 512]
    if args.model:
        worker_args += ["--model", args.model]
    print(f"[{mode}] starting the stack", flush=True)
    stack = Stack(os.path.join(root, mode), mode, worker_args, args.tensor_parallel_size)
    http_url = f"http://127.0.0.1:{stack.api.port}"
    try:
        health = checks.HealthSampler(stack.forwarder.address, http_url)
        memory = checks.MemorySampler(stack.processes, stack.group.master_port, args.sample_s)
        started = time.monotonic()
        load = Load(stack.forwarder.address, http_url, args.concurrency, args.seed, args.max_tokens, tag=f"{mode}-run")
        schedule = fault_schedule(args)
        rng = random.Random(args.seed + 1)
        # A soak spreads its faults over the duration; a chaos run leaves a few seconds of load between them.
        gap = (args.duration_s - args.warmup_s) / (len(schedule) + 1) if args.duration_s else None
        time.sleep(args.warmup_s if not args.duration_s else min(args.warmup_s, args.duration_s))
        faults = []
        for i, kind in enumerate(schedule):
            time.sleep(gap if gap is not None else rng.uniform(args.gap_s / 2, args.gap_s))
            t0 = time.monotonic()
            row: dict = {"n": i, "kind": kind, "at_s": round(t0 - started, 2), "at": time.time()}
            try:
                row["info"] = stack.inject(kind)
            except Exception as e:  # a stack that does not come back is the finding: record it and go on
                row["error"] = f"{type(e).__name__}: {e}"
                try:
                    stack.wait_serving()
                except TimeoutError:
                    pass
            serving = time.monotonic()
            row["recovered_s"] = round(serving - t0, 2)
            # The next fault waits until every open stream has had a message again: SERVING comes before the new
            # leader has recomputed its queue, which it does from the front, and faults that come as soon as the
            # head has a token add up, for the streams at the tail, to one outage longer than any client's timeout
            # (the streams then lost are the schedule's, not the recovery's).
            caught_up = load.progress.wait_after(serving, RECOVER_TIMEOUT_S)
            row["progress_s"] = round(time.monotonic() - t0, 2) if caught_up else None
            if not caught_up:
                row["streams_behind"] = load.progress.behind(serving)
            faults.append(row)
            print(f"[{mode}] fault {i + 1}/{len(schedule)}: {kind} recovered in {row['recovered_s']:.1f}s, every "
                  f"stream had a message again after {row['progress_s'] or float('nan'):.1f}s"
                  + (f" ({row['streams_behind']} streams still without one)" if not caught_up else "")
                  + (f" ({row['error']})" if "error" in row else ""), flush=True)
        while args.duration_s and time.monotonic() - started < args.duration_s:
            time.sleep(1)
        time.sleep(args.cooldown_s)
        load.stop()
        results = load.join()
        health_samples, memory_samples = health.stop(), memory.stop()
        run_s = time.monotonic() - started
        print(f"[{mode}] {len(results)} streams in {run_s:.0f}s; checking", flush=True)
        primary = stack.group.wait_settled()
        ledger_after_run = checks.ledger_state(primary, stack.namespace)
        replay: list[Result] = []
        if not args.skip_replay:
            # The same work as the run without its outages: a long run's replay may take longer than the default.
            specs = [r.spec for r in results if r.spec.kind != "cancel"]
            replay = Load(stack.forwarder.address, http_url, args.concurrency, args.seed, args.max_tokens,
                          specs=specs, tag=f"{mode}-replay").join(timeout=max(1800.0, 2 * run_s))
        ledger_end = checks.ledger_state(stack.group.wait_settled(), stack.namespace)
        logs = {f"scheduler-{i}": s.log_path for i, s in enumerate(stack.schedulers)}
        logs.update(worker=stack.worker.log_path, api=stack.api.log_path)
        found = checks.log_findings(logs)
        run_rows, replay_rows = [r.row() for r in results], [r.row() for r in replay]
        # Without a replay only errors and divergences can be told (each stream is its own reference).
        verdict = checks.compare(run_rows, replay_rows if replay else run_rows)
        behind = sum(f["behind"] for f in found.values())
        leaked = (ledger_after_run["leaked_blocks"] + ledger_after_run["leaked_slots"]
                  + ledger_after_run["leaked_requests"] + ledger_after_run["overlap"])
        return {
            "mode": mode, "run_s": run_s, "faults": faults, "fault_counts": dict(Counter(f["kind"] for f in faults)),
            "fault_errors": sum("error" in f for f in faults),
            "kinds": dict(Counter(r.spec.kind for r in results)), **verdict,
            "changed_allowed": mode != "replica" and behind > 0, "behind_events": behind,
            "leaked": leaked, "ledger_after_run": ledger_after_run, "ledger_end": ledger_end,
            "health": checks.health_summary(health_samples),
            "memory": checks.memory_growth(memory_samples, args.warmup_s, args.rss_bound_mib, args.redis_bound_mib),
            "memory_samples": memory_samples, "logs": found, "streams_detail": run_rows,
            "replay_detail": replay_rows, "replayed": len(replay),
            "tokens": sum(len(t) for r in results for t in r.tokens),
            "http_503_retried": sum(r.refused for r in results),
        }
    finally:
        stack.stop()


def _by_kind(faults: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in faults:
        out.setdefault(f["kind"], []).append(f)
    return out


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"## Chaos run (seed {a['seed']}, {a['concurrency']} streams, "
             f"{a['duration_s'] or 'no'} soak duration)", "",
             "| mode | faults | fault errors | streams | checked | cancelled | lost | changed | leaked | health late "
             "| max health s | longest not SERVING s | longest stall s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in report["modes"]:
        faults = ", ".join(f"{n} {k}" for k, n in sorted(m["fault_counts"].items())) or "none"
        changed = f"{len(m['changed'])}" + (" (allowed: replica behind)" if m["changed"] and m["changed_allowed"]
                                            else "")
        h = m["health"]
        lines.append(f"| {m['mode']} | {faults} | {m['fault_errors']} | {m['streams']} | {m['checked']} | "
                     f"{m.get('cancelled', 0)} | {len(m['lost'])} | {changed} | {m['leaked']} | {h['late']} | "
                     f"{max(h['max_grpc_s'], h['max_http_s']):.2f} | {h['longest_not_serving_s']:.1f} | "
                     f"{m['longest_stall_s']:.1f} |")
    for m in report["modes"]:
        lost_by = Counter(x["why"].split(":")[0] for x in m["lost"])
        lines += ["", f"**{m['mode']}**: {m['tokens']} tokens in {m['run_s']:.0f} s; lost by error: "
                  f"{dict(lost_by) or 'none'}; lost by kind: {dict(Counter(x['kind'] for x in m['lost'])) or 'none'}; "
                  f"changed by kind: {dict(Counter(x['kind'] for x in m['changed'])) or 'none'}; promoted replica "
                  f"behind: {m['behind_events']} times; log lines that look like failures: "
                  f"{ {k: v['findings'] for k, v in m['logs'].items()} }."]
        for kind, rows in sorted(_by_kind(m["faults"]).items()):
            serving = [f["recovered_s"] for f in rows]
            tokens = [f["progress_s"] for f in rows if f.get("progress_s") is not None]
            lines.append(f"- {kind} x{len(rows)}: SERVING again after {min(serving):.1f}-{max(serving):.1f} s"
                         + (f", every stream had a message again after {min(tokens):.1f}-{max(tokens):.1f} s"
                            if tokens else "")
                         + (f", {len(rows) - len(tokens)} waits past {RECOVER_TIMEOUT_S:.0f} s"
                            if len(tokens) < len(rows) else ""))
        for x in (m["lost"] + m["changed"])[:8]:
            lines.append(f"- stream {x['index']} ({x['kind']}): {x['why'][:200]}")
        mem = m["memory"]
        if mem.get("checked"):
            growth = ", ".join(f"{k} {v:+.1f}" for k, v in mem["rss_growth_mib"].items() if v is not None)
            lines.append(f"- memory after {mem['warmup_s']:.0f} s warm-up, over {mem['window_s']:.0f} s: RSS growth "
                         f"MiB {growth}; Redis used_memory {mem['redis_used_growth_mib'] or 0:+.2f} MiB; bounds "
                         f"{mem['rss_bound_mib']} / {mem['redis_bound_mib']} MiB; over: {mem['over_bound'] or 'none'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--primary-kills", type=int, default=5, help="kill -9 of the Redis primary")
    p.add_argument("--primary-stops", type=int, default=1, help="SIGSTOP/SIGCONT of the primary (a partition)")
    p.add_argument("--scheduler-kills", type=int, default=5, help="kill -9 of the leading scheduler")
    p.add_argument("--worker-kills", type=int, default=3, help="kill -9 of the worker")
    p.add_argument("--tp-rank-kills", type=int, default=0,
                   help="kill -9 of a rank other than 0 (--tensor-parallel-size 2 or more; the bundled SmolLM2: 3)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16, help="streams kept running at once")
    p.add_argument("--seed", type=int, default=0, help="draws the request mix and the order of the faults")
    p.add_argument("--durability", nargs="+", choices=MODES, default=list(MODES),
                   help="the schedulers' --redis-durability; each mode runs on a fresh stack")
    p.add_argument("--max-tokens", type=int, default=48, help="a request asks for max_tokens/2 .. max_tokens")
    p.add_argument("--gap-s", type=float, default=6.0, help="load between two faults: gap/2 .. gap seconds")
    p.add_argument("--warmup-s", type=float, default=5.0, help="load before the first fault (soak: memory warm-up)")
    p.add_argument("--cooldown-s", type=float, default=3.0, help="load after the last fault")
    p.add_argument("--duration-s", type=float, default=0.0, help="a soak: run the load this long")
    p.add_argument("--sample-s", type=float, default=5.0, help="memory sampling interval")
    p.add_argument("--rss-bound-mib", type=float, default=64.0, help="allowed RSS growth per process after warm-up")
    p.add_argument("--redis-bound-mib", type=float, default=32.0, help="allowed used_memory growth after warm-up")
    p.add_argument("--num-blocks", type=int, default=512, help="the worker's --num-gpu-blocks-override")
    p.add_argument("--model", default=None, help="the worker's --model (default: the bundled SmolLM2-135M)")
    p.add_argument("--skip-replay", action="store_true", help="no undisturbed replay (a long soak)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.tp_rank_kills and args.tensor_parallel_size < 2:
        p.error("--tp-rank-kills needs --tensor-parallel-size 2 or more")
    root = tempfile.mkdtemp(prefix="chaos-")
    report = {"args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "logs": root,
              "modes": [run_mode(mode, args, root) for mode in args.durability]}
    path = args.json or os.path.join(ROOT, "experiments", "out", f"chaos-{time.strftime('%Y%m%dT%H%M%SZ')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    print(markdown(report))
    print(f"\nJSON: {path}; logs: {root}")


if __name__ == "__main__":
    main()
