"""The worker protocol's cost per decode step: bytes on the wire and the host time to build, serialize, parse and
read a plan and its result, at 16, 64 and 256 running decode-only requests.

The real scheduling core plans the steps (`SchedulerCore.schedule`), the version's own worker client encodes the
plan and decodes the result, and a real `ModelRunner` (2-layer random Llama, hidden 64, CPU) runs it in between,
so every number is the product code's. Per decode step, p50:

* plan bytes, result bytes: the serialized StepPlan and StepResult,
* encode: the worker client's encode_plan + SerializeToString (scheduler),
* parse: StepPlan.FromString (worker),
* worker: ModelRunner.execute minus its forward (plan check and apply, inputs, sampling, building the result),
* result: StepResult SerializeToString (worker) + FromString + the client's decode to tokens (scheduler),
* wire: encode + parse + result (what the protocol's format costs outside the worker's batch code).

With `--baseline-ref REV` the same measurement runs on REV too (a `git worktree`, its own process), side by side:
v1 plans and results are nested messages with string ids, v2's are packed arrays addressed by slot.

    .venv/bin/python -m experiments.worker_wire --baseline-ref 0c1ac8c
    .venv/bin/python -m experiments.worker_wire --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from experiments.worker_host_path import BLOCK_SIZE, make_model, wire_execute

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("plan_bytes", "result_bytes", "encode", "parse", "worker", "result", "wire")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--running", default="16,64,256", help="running decodes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--baseline-ref", default=None, help="also measure this git revision, side by side")
    p.add_argument("--smoke", action="store_true", help="4 running, 3 steps")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--source", default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.running, args.steps, args.warmup, args.prompt_len = "4", 3, 1, 16
    args.running = [int(x) for x in str(args.running).split(",") if x.strip()]
    if not args.running or min(args.running) < 1 or args.steps < 1:
        p.error("need --running >= 1 and --steps >= 1")
    return args


def run_size(model: str, n: int, args: argparse.Namespace) -> dict:
    import torch

    from common.sampling_fields import SamplingParams
    from protos import worker_pb2 as pb
    from scheduler_svc.core.block_pool import BlockPool
    from scheduler_svc.core.policy import PolicyConfig
    from scheduler_svc.core.request import Request
    from scheduler_svc.core.scheduler import SchedulerCore
    from scheduler_svc.driver import worker_client as wc
    from worker_svc.config import WorkerConfig
    from worker_svc.core.runner import ModelRunner

    total = args.warmup + args.steps
    per_request = -(-(args.prompt_len + total + 2) // BLOCK_SIZE)
    num_blocks = n * per_request + 1
    runner = ModelRunner(WorkerConfig(model=model, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                       num_gpu_blocks_override=num_blocks,
                                       max_model_len=args.prompt_len + total + 16))
    execute = wire_execute(runner)
    policy = PolicyConfig(max_num_seqs=n, max_num_batched_tokens=n * args.prompt_len, block_size=BLOCK_SIZE,
                          enable_prefix_caching=False)
    core = SchedulerCore(policy, BlockPool(num_blocks))
    for i in range(n):
        rid = f"cmpl-{i:04d}-{(i * 2654435761) % (1 << 32):08x}"  # as long as a typical generated id
        core.add([Request(rid, [3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)],
                          SamplingParams(temperature=0.0, seed=i, ignore_eos=True, max_tokens=total + 2),
                          arrival_time=0.0)])
    v2 = hasattr(wc, "decode_result")
    client = wc.WorkerClient("127.0.0.1:9") if v2 else None  # a channel that never connects: its slot table

    def encode(out, step_id: int):
        kw = dict(step_id=step_id, token=1, epoch=runner.epoch, reset=core.reset_worker, dropped=core.to_drop)
        plan = wc.encode_plan(out, client.slots, **kw) if v2 else wc.encode_plan(out, **kw)
        core.reset_worker, core.to_drop = False, []
        return plan

    def decode(result):
        return client._decode(result, client.slots.snapshot()) if v2 else wc._decode(result)

    rows = {k: [] for k in METRICS}
    for step_id in range(1, total + 2):
        out = core.schedule(0.0)
        t0 = time.perf_counter()
        data = encode(out, step_id).SerializeToString()
        t1 = time.perf_counter()
        plan = pb.StepPlan.FromString(data)
        t2 = time.perf_counter()
        with torch.inference_mode():
            result = execute(plan)
        t3 = time.perf_counter()
        blob = result.SerializeToString()
        output = decode(pb.StepResult.FromString(blob))
        t4 = time.perf_counter()
        core.update_from_output(out, output, 0.0)
        decode_only = all(out.num_tokens[r.request_id] == 1 for r in out.scheduled) and len(out.scheduled) == n
        if step_id > args.warmup + 1:
            assert decode_only and len(output.tokens) == n, "not a decode-only step of every request"
            rows["plan_bytes"].append(len(data))
            rows["result_bytes"].append(len(blob))
            rows["encode"].append(t1 - t0)
            rows["parse"].append(t2 - t1)
            rows["worker"].append(t3 - t2 - result.forward_seconds)
            rows["result"].append(t4 - t3)
            rows["wire"].append(t1 - t0 + t2 - t1 + t4 - t3)
    tokens = [tuple(r.output_ids) for r in sorted(core.running, key=lambda r: r.request_id)]
    return {"running": n, "protocol": pb.DESCRIPTOR.package, "rows": rows, "outputs": hash(tuple(tokens))}


def child_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.source)
    import torch

    torch.set_num_threads(1)
    with open(args.child, "w") as f:
        json.dump([run_size(args.model, n, args) for n in args.running], f)


def run_version(args: argparse.Namespace, source: str, model: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"wire-{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "experiments.worker_wire", "--child", out, "--source", source, "--model", model,
           "--running", ",".join(map(str, args.running)), "--prompt-len", str(args.prompt_len),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for version, sizes in results.items():
        for s in sizes:
            med = {k: statistics.median(v) for k, v in s["rows"].items()}
            rows.append({"version": version, "protocol": s["protocol"], "running": s["running"],
                         "steps": len(s["rows"]["wire"]), "outputs": s["outputs"],
                         **{k: med[k] if k.endswith("bytes") else 1e3 * med[k] for k in METRICS}})
    return sorted(rows, key=lambda r: (r["running"], r["version"] != "baseline"))


def print_table(rows: list[dict]) -> None:
    head = (f"{'running':>7} {'version':<9} {'protocol':<19} {'plan B':>8} {'result B':>9} {'encode':>8} "
            f"{'parse':>8} {'worker':>8} {'result':>8} {'wire':>8}   (p50; times in ms per step)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['running']:>7} {r['version']:<9} {r['protocol']:<19} {r['plan_bytes']:>8.0f} "
              f"{r['result_bytes']:>9.0f}" + "".join(f" {r[k]:>8.3f}" for k in METRICS[2:]))
    by = {(r["running"], r["version"]): r for r in rows}
    for n in sorted({r["running"] for r in rows}):
        if (n, "baseline") in by:
            old, new = by[(n, "baseline")], by[(n, "current")]
            same = "identical" if old["outputs"] == new["outputs"] else "DIFFER"
            print(f"{n} running: plan {old['plan_bytes'] / new['plan_bytes']:.1f}x smaller, result "
                  f"{old['result_bytes'] / new['result_bytes']:.1f}x smaller, wire time "
                  f"{old['wire'] / new['wire']:.1f}x less, worker time {old['worker'] / new['worker']:.2f}x less; "
                  f"outputs {same}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    tmp = tempfile.mkdtemp(prefix="worker-wire-")
    worktree = None
    try:
        model = make_model(os.path.join(tmp, "model"))
        versions = [("current", REPO)]
        if args.baseline_ref is not None:
            worktree = os.path.join(tmp, "baseline")
            subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--quiet", worktree, args.baseline_ref],
                           check=True)
            versions.insert(0, ("baseline", worktree))
        results = {v: run_version(args, src, model, tmp) for v, src in versions}
        rows = summarize(results)
        print(f"decode-only steps, prompt {args.prompt_len}, {args.steps} timed steps per size"
              + (f", baseline {args.baseline_ref}" if worktree else ""))
        print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": rows, "results": results}, f, indent=1)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
