"""The worker's host path: `ModelRunner.execute` in one process on a 2-layer random-weight Llama (hidden 64), with
16, 64 and 256 running decodes after a prefill. Per step, p50 / p99 of

* prepare: plan check + apply + model inputs and attention metadata (StepResult.prepare_seconds),
* forward (StepResult.forward_seconds),
* sample: sampling + the StepResult's tokens (StepResult.sample_seconds),
* host: the step's wall time minus the forward (everything the worker does outside the model),
* total: the step's wall time.

Cases: `greedy` (every request greedy) and `mixed` (an eighth each seeded top-p, seeded top-k + min-p + logprobs,
penalties, min_tokens with a stop token; the rest greedy). The plans are deterministic, so the sampled tokens of
two versions can be compared: with `--baseline-ref REV` the same measurement also runs on REV (checked out with
`git worktree` in a temporary directory, each version in its own process, `--rounds` times alternately) and the
table shows both side by side, with whether their outputs are identical. The plans are built in the measured
version's worker protocol (v1: by request id; v2: by slot, packed), so a revision before the v2 wire compares too.

    .venv/bin/python -m experiments.worker_host_path
    .venv/bin/python -m experiments.worker_host_path --baseline-ref HEAD~1 --rounds 2 --json /tmp/host.json
    .venv/bin/python -m experiments.worker_host_path --smoke        # 4 decodes, a few steps: seconds
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from llmserve.bench.metrics import percentile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE = 16
VOCAB = 1024
PHASES = ("prepare", "forward", "sample", "host", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--decodes", default="16,64,256", help="running decodes per case, comma-separated")
    p.add_argument("--cases", default="greedy,mixed", help="sampling mixes: greedy, mixed")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--baseline-ref", default=None, help="also measure this git revision, side by side")
    p.add_argument("--rounds", type=int, default=1, help="with --baseline-ref: alternate the versions this often")
    p.add_argument("--smoke", action="store_true", help="4 decodes, 16-token prompts, 3 steps")
    p.add_argument("--json", default=None, help="write the per-step timings and the summary here")
    # internal: measure one version in this process, importing the worker from --source
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--source", default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.decodes, args.prompt_len, args.steps, args.warmup = "4", 16, 3, 1
    args.decodes = [int(x) for x in str(args.decodes).split(",") if x.strip()]
    args.cases = [c for c in args.cases.split(",") if c.strip()]
    if set(args.cases) - {"greedy", "mixed"} or not args.decodes or min(args.decodes) < 1 or args.steps < 1:
        p.error("--cases takes greedy and/or mixed; need decodes >= 1 and --steps >= 1")
    return args


def make_model(path: str) -> str:
    """A random-weight 2-layer Llama saved as an HF directory, as tests/e2e/test_model.py builds one."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


# ------------------------------------------------------------------------------------ one version


def sampling_for(case: str, i: int):
    from protos import worker_pb2 as pb

    kw: dict = {"ignore_eos": True}
    if case == "mixed":
        kind = i % 8
        if kind == 1:
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        elif kind == 3:
            kw.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
        elif kind == 5:
            kw.update(temperature=1.0, top_k=20, min_p=0.05, seed=i, logprobs=3)
        elif kind == 7:
            kw.update(min_tokens=1 << 20, stop_token_ids=[5])
    return pb.SamplingParams(**kw)


def speaks_v2(pb) -> bool:
    """The measured version's worker protocol: v2 addresses requests by slot in packed arrays, v1 by id."""
    return pb.DESCRIPTOR.package.endswith(".v2")


def result_tokens(pb, res, rids: list[str]) -> list[tuple[str, int, int, float | None, list[tuple[int, float]]]]:
    """(request id, token, finish reason, logprob, top logprobs) per sampled token, from either version's result
    (v2: the slot of request i is i)."""
    if not speaks_v2(pb):
        return [(t.request_id, t.token_id, t.finish_reason, t.logprob if t.HasField("logprob") else None,
                 [(x.token_id, x.logprob) for x in t.top_logprobs]) for t in res.tokens]
    reasons = list(res.finish_reasons) or [0] * len(res.slots)
    out = [(rids[s], t, f, None, []) for s, t, f in zip(res.slots, res.token_ids, reasons, strict=True)]
    at = 0
    for i, lp, k in zip(res.logprob_indices, res.logprobs, res.num_top_logprobs, strict=True):
        top = list(zip(res.top_logprob_token_ids[at: at + k], res.top_logprobs[at: at + k], strict=True))
        out[i] = (*out[i][:3], lp, top)
        at += k
    return out


def wire_execute(runner):
    """runner's step on a wire StepPlan, returning a StepResult, in either version: the gRPC edge converts for a
    runner with a plain core, an older runner took the message itself."""
    try:
        from worker_svc.server import execute_step
    except ImportError:
        return runner.execute
    return lambda plan: execute_step(runner, plan)


def run_case(model: str, case: str, n: int, args: argparse.Namespace) -> dict:
    """Prefill n requests in one step, then time decode steps of all n (a new block every BLOCK_SIZE tokens)."""
    import random

    import torch

    from protos import worker_pb2 as pb
    from worker_svc.config import WorkerConfig
    from worker_svc.core.runner import ModelRunner

    gc.collect()  # the previous case's runner and KV pool go first
    total_steps = args.warmup + args.steps
    per_request = -(-(args.prompt_len + total_steps + 1) // BLOCK_SIZE)
    runner = ModelRunner(WorkerConfig(model=model, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                       num_gpu_blocks_override=n * per_request + 1,
                                       max_model_len=args.prompt_len + total_steps + 16))
    execute = wire_execute(runner)
    rng = random.Random(n)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    rids = [f"req-{case}-{i:04d}-{rng.getrandbits(32):08x}" for i in range(n)]
    blocks = {rid: [free.pop() for _ in range(-(-args.prompt_len // BLOCK_SIZE))] for rid in rids}
    v2 = speaks_v2(pb)
    plan = pb.StepPlan(step_id=1)
    for i, rid in enumerate(rids):
        prompt = [rng.randrange(3, VOCAB) for _ in range(args.prompt_len)]
        entry = plan.new_requests.add(request_id=rid, prompt_token_ids=prompt,
                                      sampling=sampling_for(case, i), block_ids=blocks[rid],
                                      num_scheduled_tokens=args.prompt_len)
        if v2:
            entry.slot = i
    digest = hashlib.sha256()

    def step(plan: pb.StepPlan) -> tuple[pb.StepResult, float]:
        # Inference mode for both versions: before the persistent input batch, the sampler updated the model's
        # logits (inference tensors) in place outside it, which fails on CPU for penalties and min_tokens.
        with torch.inference_mode():
            t = time.perf_counter()
            res = execute(plan)
            wall = time.perf_counter() - t
        tokens = result_tokens(pb, res, rids)
        for rid, tok, finish, logprob, top_logprobs in tokens:
            lp = struct.pack("<f", logprob) if logprob is not None else b""
            top = b"".join(struct.pack("<if", t, v) for t, v in top_logprobs)
            digest.update(f"{rid}:{tok}:{finish}:".encode() + lp + top)
        return res, tokens, wall

    step(plan)
    num_tokens = args.prompt_len + 1
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for s in range(total_steps):
        plan = pb.StepPlan(step_id=s + 2)
        news = []
        for rid in rids:
            new = [free.pop()] if num_tokens > len(blocks[rid]) * BLOCK_SIZE else []
            blocks[rid] += new
            news.append(new)
            if not v2:
                plan.cached_requests.add(request_id=rid, new_block_ids=new, num_scheduled_tokens=1)
        if v2:
            plan.cached.slots.extend(range(n))
            plan.cached.num_scheduled_tokens.extend([1] * n)
            if any(news):
                plan.cached.num_new_blocks.extend(map(len, news))
                plan.cached.new_block_ids.extend(b for new in news for b in new)
        res, tokens, wall = step(plan)
        assert len(tokens) == n and not any(t[2] for t in tokens), "a request finished early"
        num_tokens += 1
        if s >= args.warmup:
            times["prepare"].append(res.prepare_seconds)
            times["forward"].append(res.forward_seconds)
            times["sample"].append(res.sample_seconds)
            times["host"].append(wall - res.forward_seconds)
            times["total"].append(wall)
    return {"case": case, "decodes": n, "times": times, "digest": digest.hexdigest()}


def child_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.source)  # the version to measure: its worker_svc, kernels, protos, common
    import torch

    torch.set_num_threads(args.threads)
    out = [run_case(args.model, case, n, args) for case in args.cases for n in args.decodes]
    with open(args.child, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------------------- driver


def run_version(args: argparse.Namespace, source: str, model: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"result-{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "experiments.worker_host_path", "--child", out, "--source", source, "--model", model,
           "--decodes", ",".join(map(str, args.decodes)), "--cases", ",".join(args.cases),
           "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def merge(runs: list[list[dict]]) -> list[dict]:
    """Rounds of one version: per case, the steps of every round together (the digests must agree)."""
    merged = [dict(r, times={k: list(v) for k, v in r["times"].items()}) for r in runs[0]]
    for run in runs[1:]:
        for m, r in zip(merged, run, strict=True):
            assert m["digest"] == r["digest"], f"{m['case']} {m['decodes']}: outputs differ between rounds"
            for k in PHASES:
                m["times"][k] += r["times"][k]
    return merged


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for version, cases in results.items():
        for c in cases:
            stats = {k: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * percentile(v, 99)}
                     for k, v in c["times"].items()}
            rows.append({"version": version, "case": c["case"], "decodes": c["decodes"],
                         "steps": len(c["times"]["total"]), "digest": c["digest"], **stats})
    return sorted(rows, key=lambda r: (r["case"], r["decodes"], r["version"] != "baseline"))


def print_table(rows: list[dict], versions: list[str]) -> None:
    head = f"{'case':<7} {'decodes':>7} {'version':<9}" + "".join(f" {k + ' p50/p99':>17}" for k in PHASES)
    print(head + "   (ms per step)")
    print("-" * len(head))
    for r in rows:
        cells = "".join(f" {r[k]['p50_ms']:>8.2f}/{r[k]['p99_ms']:<8.2f}" for k in PHASES)
        print(f"{r['case']:<7} {r['decodes']:>7} {r['version']:<9}{cells}")
    if len(versions) == 2:
        by = {(r["case"], r["decodes"], r["version"]): r for r in rows}
        for case, n in sorted({(r["case"], r["decodes"]) for r in rows}):
            same = by[(case, n, versions[0])]["digest"] == by[(case, n, versions[1])]["digest"]
            print(f"{case} {n}: sampled tokens and logprobs {'identical' if same else 'DIFFER'} across versions")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    tmp = tempfile.mkdtemp(prefix="host-path-")
    worktree = None
    try:
        model = make_model(os.path.join(tmp, "model"))
        if args.baseline_ref is None:
            sys.path.insert(0, REPO)
            args.model = model
            import torch

            torch.set_num_threads(args.threads)
            results = {"current": [run_case(model, case, n, args) for case in args.cases for n in args.decodes]}
        else:
            worktree = os.path.join(tmp, "baseline")
            subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--quiet", worktree, args.baseline_ref],
                           check=True)
            runs: dict[str, list[list[dict]]] = {"baseline": [], "current": []}
            for r in range(args.rounds):
                order = [("baseline", worktree), ("current", REPO)]
                for version, source in order if r % 2 == 0 else order[::-1]:
                    print(f"round {r + 1}/{args.rounds}: {version}", file=sys.stderr, flush=True)
                    runs[version].append(run_version(args, source, model, tmp))
            results = {v: merge(rs) for v, rs in runs.items()}
        rows = summarize(results)
        print(f"2-layer random Llama (hidden 64, vocab {VOCAB}), CPU fp32, {args.threads} thread(s), prompt "
              f"{args.prompt_len}, {args.steps} timed decode steps per case"
              + (f", baseline {args.baseline_ref}, {args.rounds} round(s)" if worktree else ""))
        print_table(rows, list(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "source", "model")},
                           "summary": rows, "results": results}, f, indent=1)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
