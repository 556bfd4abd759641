"""`llmserve bench fleet`: one workload through the smg gateway in front of several llmserve pools, once per routing
policy, each policy on a fresh set of pools (empty prefix caches), so that the policies compare on equal terms.

A pool is one launched `llmserve serve` (its own redis-server, worker and scheduler; the HTTP API off). Per policy:
start the pools, warm each one up over gRPC (untimed), start `smg launch --backend vllm --policy POLICY` in front
of them, send the workload through it with the OpenAI load generator (text prompts: smg tokenizes them itself) and
scrape every pool's /metrics before and after. The default workload is `rag` sized for the question the gateway's
policy answers: a few ~512-token documents shared as prompt prefixes, a short distinct question each, few output
tokens. What a policy changes is where a shared prefix is computed: `cache_aware` keeps a document's requests on
the pool that computed it, `round_robin` spreads them, so each document is prefilled on every pool.

Per policy the record (one JSON per run) adds `fleet`: the prefix hit rate (`vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`, summed over the pools), the prompt tokens the pools computed, and per pool the
requests it finished and its hits; plus the counters of smg's own routing decisions where smg exports them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from llmserve import processes, smg_gateway
from llmserve.bench import loadgen, metrics, report, runner
from llmserve.bench.runner import LocalServer, RunSettings, Target, model_info

POOL_MODE = "chunked"  # what `llmserve serve` runs by default
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# Per-pool counters the record reports, as deltas over the measured run.
POOL_COUNTERS = {"requests": "vllm:request_success_total", "prefix_cache_hits": "vllm:prefix_cache_hits_total",
                 "prefix_cache_queries": "vllm:prefix_cache_queries_total",
                 "prompt_tokens_computed": "vllm:prompt_tokens_total"}
SMG_BRANCHES = "smg_cache_aware_policy_branch_total"  # which rule picked the pool (prefix match, balance, ...)


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise SystemExit(f"--policies takes a comma-separated list from {', '.join(POLICIES)}; got {text!r}")
    return policies


def _counters(pool: LocalServer) -> dict[str, float]:
    sample = metrics.scrape(pool.metrics_url)
    return {key: metrics.metric_sum(sample, name) for key, name in POOL_COUNTERS.items()}


def _smg_branches(gateway: processes.Proc) -> dict[str, float]:
    """smg's cache-aware routing decisions by branch (empty for other policies or where it does not export them)."""
    try:
        sample = metrics.scrape(f"http://127.0.0.1:{gateway.extra['metrics_port']}/metrics")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for (name, labels), value in sample.items():
        if name == SMG_BRANCHES:
            branch = ",".join(f"{k}={v}" for k, v in labels if k not in ("model", "model_id", "worker"))
            out[branch] = out.get(branch, 0.0) + value
    return out


def fleet_summary(policy: str, pools: list[LocalServer], before: list[dict], after: list[dict]) -> dict:
    per_pool = [{"address": p.address, **{k: a[k] - b[k] for k in POOL_COUNTERS}}
                for p, b, a in zip(pools, before, after, strict=True)]
    total = {k: sum(p[k] for p in per_pool) for k in POOL_COUNTERS}
    return {"policy": policy, "num_pools": len(pools), **total,
            "prefix_hit_rate": (total["prefix_cache_hits"] / total["prefix_cache_queries"]
                                if total["prefix_cache_queries"] else None),
            "pools": per_pool}


def run_policy(policy: str, settings: RunSettings, args: argparse.Namespace, server_extra: list[str]) -> dict:
    """Fresh pools, smg with `policy` in front of them, one measured run; the record with its `fleet` part."""
    with contextlib.ExitStack() as pools_up:
        pools = [LocalServer(POOL_MODE, args.max_model_len, server_extra,
                             os.path.join(args.result_dir, f"pool{i}_{policy}.log")) for i in range(args.pools)]
        for pool in pools:
            pools_up.push(pool.__exit__)  # stops whichever started, also when another one failed to
        print(f"[bench] {policy}: starting {len(pools)} pools, logs {', '.join(p.log_path for p in pools)}",
              file=sys.stderr, flush=True)
        with ThreadPoolExecutor(len(pools)) as starting:  # side by side: model loading dominates
            list(starting.map(LocalServer.__enter__, pools))
        for pool in pools:  # first-step costs and the detokenizer load, outside the gateway and the measurement
            asyncio.run(loadgen.warm_up(loadgen.GrpcTransport(pool.address, settings.api_key), settings.warmup))
        gateway = smg_gateway.start_smg([p.address for p in pools], policy, args.smg_args.split(),
                                  log_path=os.path.join(args.result_dir, f"smg_{policy}.log"))
        pools_up.callback(processes.stop, gateway)
        url = f"http://127.0.0.1:{gateway.port}"
        target = Target(backend="openai", mode=f"smg-{policy}", http_url=url, api_pid=gateway.pid,
                        text_prompts=True, model=model_info(pools[0].address, settings.api_key),
                        server_argv=pools[0].argv, server_flags=pools[0].flags)
        smg = loadgen.HttpTransport(url, settings.api_key, runner.prompt_text(target))
        asyncio.run(loadgen.warm_up(smg, settings.warmup))  # smg's first calls
        branches_before = _smg_branches(gateway)
        before = [_counters(p) for p in pools]
        record = runner.run(target, dataclasses.replace(settings, warmup=0))
        after = [_counters(p) for p in pools]
        record["fleet"] = fleet_summary(policy, pools, before, after)
        branches = _smg_branches(gateway)
        record["fleet"]["smg_cache_aware_branches"] = {
            k: v - branches_before.get(k, 0.0) for k, v in branches.items() if v - branches_before.get(k, 0.0)}
    path = report.write_json(record, args.result_dir)
    f = record["fleet"]
    rate = "-" if f["prefix_hit_rate"] is None else f"{f['prefix_hit_rate']:.3f}"
    print(f"[bench] {policy}: {record['completed']} completed, {record['failed']} failed, prefix hit rate {rate}, "
          f"requests per pool {[p['requests'] for p in f['pools']]} -> {path}", file=sys.stderr, flush=True)
    return record


def markdown_table(records: list[dict]) -> str:
    """One row per policy, then each policy against round_robin's run of the same workload (or the first run's)."""
    cols = ("policy", "pools", "ok/failed", "prefix hit rate", "prefix hits (tokens)", "prompt tokens computed",
            "TTFT p50 (ms)", "TTFT p99 (ms)", "req/s", "requests per pool")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        f = r["fleet"]
        lines.append("| " + " | ".join([
            f["policy"], str(f["num_pools"]), f"{r['completed']}/{r['failed']}", report.fmt(f["prefix_hit_rate"], 3),
            report.fmt(f["prefix_cache_hits"], 0), report.fmt(f["prompt_tokens_computed"], 0),
            report.fmt(r["ttft_ms"]["p50"]), report.fmt(r["ttft_ms"]["p99"]), report.fmt(r["request_throughput"], 2),
            " / ".join(report.fmt(p["requests"], 0) for p in f["pools"])]) + " |")
    base = next((r for r in records if r["fleet"]["policy"] == "round_robin"), records[0])
    for r in records:
        if r is not base:
            lines.append("")
            lines.append(f"{r['fleet']['policy']} / {base['fleet']['policy']}: " + ", ".join(
                f"{name} {report.ratio(pick(r), pick(base))}" for name, pick in (
                    ("prefix hits", lambda x: x["fleet"]["prefix_cache_hits"]),
                    ("prompt tokens computed", lambda x: x["fleet"]["prompt_tokens_computed"]),
                    ("TTFT p50", lambda x: x["ttft_ms"]["p50"]), ("TTFT p99", lambda x: x["ttft_ms"]["p99"]),
                    ("req/s", lambda x: x["request_throughput"]))))
    return "\n".join(lines) + "\n"
