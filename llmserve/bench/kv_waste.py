"""`llmserve bench kv-waste`: how much reserved KV cache holds no token, contiguous versus paged.

A seeded trace (default 1,000 requests; output lengths normal(1500, 600) rounded and clipped to [1, 8192]; prompt
lengths uniform in [128, 1024]; an output is also cut so that prompt + output fits `max_model_len`) is replayed
through the scheduler's real `BlockPool` under two schemes:

- contiguous: every request reserves `max_model_len` slots for its whole life. That is a paged pool whose block
  is `max_model_len` tokens (a request never needs a second one), so both schemes share one replay.
- paged: blocks of `block_size` tokens, one more each time a sequence's tokens cross a block boundary.

A sequence of n tokens (prompt + generated so far) holds ceil(n / block) blocks; waste = 1 - tokens / reserved
slots, summed over requests. Two views: at peak (every request at its final length), and time-averaged over the
replay (sums over every engine step of tokens held and slots reserved). Recompute is free in this model (a
preempted request resumes with the tokens it had), so every request passes through the same token counts and
the time-averaged waste depends on the trace alone; the schedule changes only the concurrency figures.

The replay is a small engine on a pool of `pool_tokens` (default 8192 * 16): each step every running sequence
gains one token; waiting requests are admitted FCFS (one step for prefill plus the first token) while the pool
has their blocks and fewer than `max_num_seqs` run; when a sequence cannot get its next block the latest admitted
one is preempted (recompute: its blocks are freed and it goes back to the front of the queue). It reports how
many sequences each scheme keeps running at once, besides the static capacity pool / (mean reserved per request).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np

from scheduler_svc.core.block_pool import BlockPool

Trace = list[tuple[int, int]]  # (prompt tokens, output tokens) per request


def make_trace(num_requests: int = 1000, mean: float = 1500.0, std: float = 600.0, max_model_len: int = 8192,
               prompt_min: int = 128, prompt_max: int = 1024, seed: int = 0, max_output: int = 8192) -> Trace:
    if not 0 <= prompt_min <= prompt_max < max_model_len:
        raise ValueError("need 0 <= prompt_min <= prompt_max < max_model_len")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_min, prompt_max + 1, size=num_requests)
    outputs = np.clip(np.rint(rng.normal(mean, std, size=num_requests)), 1, max_output).astype(np.int64)
    outputs = np.minimum(outputs, max_model_len - prompts)  # the request must fit the context
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


def reserved_slots(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def peak_waste(trace: Trace, block_size: int) -> float:
    """Share of reserved slots holding no token once every request has all its tokens."""
    used = sum(p + o for p, o in trace)
    reserved = sum(reserved_slots(p + o, block_size) for p, o in trace)
    return 1 - used / reserved


@dataclass
class ReplayStats:
    waste_time_avg: float
    steps: int
    mean_running: float
    peak_running: int
    preemptions: int


@dataclass
class _Seq:
    prompt: int
    output: int
    generated: int = 0  # tokens generated before the current admission (kept across a preemption)
    admitted: int = -1  # step of the current admission
    base: int = 0  # tokens held at the admission step
    order: int = 0  # admission counter: growth is served in this order, the largest is preempted first
    version: int = 0  # bumped on preemption, so its queued events go stale
    blocks: list[int] | None = None

    def tokens(self, step: int) -> int:
        return self.base + step - self.admitted


def replay(trace: Trace, block_size: int, pool_blocks: int, max_num_seqs: int = 256, check: bool = False
           ) -> ReplayStats:
    """Run the trace (all requests queued at step 1, in order) through a `BlockPool` of `pool_blocks` blocks.

    Event-driven: between a sequence's block-boundary crossings and its finish nothing changes but its token
    count, so steps without events are summed in closed form. `check` runs the pool's ledger check after every
    event step (slow; for tests)."""
    seqs = [_Seq(p, o) for p, o in trace]
    for s in seqs:
        if reserved_slots(s.prompt + s.output, block_size) > pool_blocks * block_size:
            raise ValueError(f"a request of {s.prompt + s.output} tokens does not fit a pool of {pool_blocks} blocks")
    pool = BlockPool(pool_blocks)
    waiting = deque(range(len(seqs)))
    running: dict[int, None] = {}  # admission order (dicts keep insertion order)
    events: list[tuple[int, int, int, int, int]] = []  # (step, kind 0=grow 1=finish, order, seq, version)
    base_sum = 0  # sum over running of (base - admitted): tokens held at step s = base_sum + len(running) * s
    used_total = reserved_total = running_total = 0
    peak = preemptions = 0
    counter = 0
    step = 1

    def schedule_growth(i: int) -> None:
        s = seqs[i]
        cap = len(s.blocks) * block_size
        if s.prompt + s.output > cap:  # it will need another block when its tokens reach cap + 1
            heapq.heappush(events, (s.admitted + cap + 1 - s.base, 0, s.order, i, s.version))

    def leave(i: int) -> None:
        nonlocal base_sum
        s = seqs[i]
        pool.release(s.blocks)
        s.blocks = None
        s.version += 1
        base_sum -= s.base - s.admitted
        del running[i]

    def preempt(i: int, now: int) -> None:
        nonlocal preemptions
        s = seqs[i]
        s.generated = s.tokens(now - 1) - s.prompt  # it does not run this step
        leave(i)
        waiting.appendleft(i)
        preemptions += 1

    while waiting or running:
        # 1. Running sequences that cross a block boundary this step, in admission order.
        preempted = False
        while events and events[0][0] == step and events[0][1] == 0:
            _, _, _, i, version = heapq.heappop(events)
            s = seqs[i]
            if version != s.version:
                continue
            while pool.num_free == 0 and i in running:
                preempt(next(reversed(running)), step)
                preempted = True
            if i in running:
                s.blocks += pool.allocate(1)
                schedule_growth(i)
        # 2. Admission, FCFS, only in a step without preemption.
        while not preempted and waiting and len(running) < max_num_seqs:
            i = waiting[0]
            s = seqs[i]
            tokens = s.prompt + s.generated + 1  # prefill, and the step's token
            need = math.ceil(tokens / block_size)
            if need > pool.num_free:
                break
            waiting.popleft()
            counter += 1
            s.blocks, s.admitted, s.base, s.order = pool.allocate(need), step, tokens, counter
            running[i] = None
            base_sum += s.base - s.admitted
            schedule_growth(i)
            # its last token comes at the step where generated reaches output
            heapq.heappush(events, (step + s.output - s.generated - 1, 1, s.order, i, s.version))
        if not running:
            raise RuntimeError("nothing can run: the pool cannot hold the next request")
        # 3. What the pool holds during this step.
        n = len(running)
        used_total += base_sum + n * step
        reserved_total += pool.num_used * block_size
        running_total += n
        peak = max(peak, n)
        # 4. Requests whose last token came in this step leave.
        freed = False
        while events and events[0][0] == step:
            _, kind, _, i, version = heapq.heappop(events)
            if kind == 1 and version == seqs[i].version:
                leave(i)
                freed = True
        if check:
            pool.check([seqs[i].blocks for i in running])
        # 5. Jump to the next step where something happens; the steps in between only accumulate.
        nxt = events[0][0] if events else step + 1
        if (freed or preempted) and waiting:
            nxt = step + 1
        if nxt > step + 1:
            gap = nxt - step - 1
            n = len(running)
            used_total += gap * base_sum + n * (step + 1 + nxt - 1) * gap // 2
            reserved_total += gap * pool.num_used * block_size
            running_total += gap * n
        step = nxt
    steps = step - 1
    return ReplayStats(waste_time_avg=1 - used_total / reserved_total if reserved_total else 0.0, steps=steps,
                       mean_running=running_total / steps if steps else 0.0, peak_running=peak,
                       preemptions=preemptions)


def kv_waste_report(num_requests: int = 1000, mean: float = 1500.0, std: float = 600.0, max_model_len: int = 8192,
                    block_size: int = 16, pool_tokens: int = 8192 * 16, seed: int = 0, prompt_min: int = 128,
                    prompt_max: int = 1024, max_num_seqs: int = 256, trace: Trace | None = None) -> dict:
    """Both schemes on one trace (generated from the parameters unless given): a JSON-ready dict."""
    if trace is None:
        trace = make_trace(num_requests, mean, std, max_model_len, prompt_min, prompt_max, seed)
    totals = [p + o for p, o in trace]
    schemes = {}
    for name, block in (("contiguous", max_model_len), ("paged", block_size)):
        stats = replay(trace, block, pool_tokens // block, max_num_seqs)
        mean_reserved = sum(reserved_slots(t, block) for t in totals) / len(totals)
        schemes[name] = {
            "block_tokens": block,
            "pool_blocks": pool_tokens // block,
            "waste_at_peak": peak_waste(trace, block),
            "waste_time_avg": stats.waste_time_avg,
            # sequences the pool holds if each is at its final length (contiguous: exactly pool // max_model_len)
            "capacity_at_full_length": (pool_tokens // block) * block / mean_reserved,
            "replay_steps": stats.steps,
            "replay_mean_running": stats.mean_running,
            "replay_peak_running": stats.peak_running,
            "replay_preemptions": stats.preemptions,
        }
    return {
        "trace": {
            "num_requests": len(trace), "seed": seed, "output_mean": mean, "output_std": std,
            "prompt_range": [prompt_min, prompt_max], "max_model_len": max_model_len,
            "mean_prompt_tokens": sum(p for p, _ in trace) / len(trace),
            "mean_output_tokens": sum(o for _, o in trace) / len(trace),
        },
        "pool_tokens": pool_tokens,
        "max_num_seqs": max_num_seqs,
        "contiguous": schemes["contiguous"],
        "paged": schemes["paged"],
    }


def markdown_table(report: dict) -> str:
    c, p, t = report["contiguous"], report["paged"], report["trace"]
    pct = "{:.2%}".format
    rows = [
        ("KV reserved per request", f"{c['block_tokens']} tokens", f"blocks of {p['block_tokens']} as it grows"),
        ("waste with all tokens generated", pct(c["waste_at_peak"]), pct(p["waste_at_peak"])),
        ("waste, time-averaged over the replay", pct(c["waste_time_avg"]), pct(p["waste_time_avg"])),
        (f"sequences a pool of {report['pool_tokens']:,} tokens holds at full length",
         f"{c['capacity_at_full_length']:.1f}", f"{p['capacity_at_full_length']:.1f}"),
        (f"running at once in the replay, mean / peak (max-num-seqs {report['max_num_seqs']})",
         f"{c['replay_mean_running']:.1f} / {c['replay_peak_running']}",
         f"{p['replay_mean_running']:.1f} / {p['replay_peak_running']}"),
        ("replay steps (makespan)", str(c["replay_steps"]), str(p["replay_steps"])),
        ("preemptions in the replay", str(c["replay_preemptions"]), str(p["replay_preemptions"])),
    ]
    lines = [
        f"KV waste: {t['num_requests']} requests (seed {t['seed']}), output normal({t['output_mean']:g}, "
        f"{t['output_std']:g}) clipped, mean {t['mean_output_tokens']:.0f} tokens; prompt uniform "
        f"{t['prompt_range'][0]}..{t['prompt_range'][1]}, mean {t['mean_prompt_tokens']:.0f}",
        "",
        f"| | contiguous (max-model-len {c['block_tokens']}) | paged (block {p['block_tokens']}) |",
        "|---|---|---|",
        *(f"| {a} | {b} | {d} |" for a, b, d in rows),
    ]
    return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--output-mean", type=float, default=1500.0, help="mean output length (tokens)")
    parser.add_argument("--output-std", type=float, default=600.0)
    parser.add_argument("--prompt-min", type=int, default=128, help="prompt lengths are uniform in [min, max]")
    parser.add_argument("--prompt-max", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=8192, help="the contiguous reservation per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=8192 * 16, help="KV pool size for the replay")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running-sequence cap in the replay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-' for stdout)")


def main(args: argparse.Namespace) -> int:
    report = kv_waste_report(args.num_requests, args.output_mean, args.output_std, args.max_model_len,
                             args.block_size, args.pool_tokens, args.seed, args.prompt_min, args.prompt_max,
                             args.max_num_seqs)
    print(markdown_table(report))
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="llmserve bench kv-waste", description=__doc__.splitlines()[0])
    add_args(p)
    sys.exit(main(p.parse_args()))
