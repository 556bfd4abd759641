"""Worker forward throughput against Hugging Face transformers on the same shapes, same process, fp32.

Cases (one sequence = one row of the batch):

* decode B at context C: one step that produces 1 token for each of B sequences with C tokens cached.
  - ours (execute): `ModelRunner.execute(StepPlan)` with the B requests as cached requests scheduled for one
    token each: plan check/apply, input preparation, attention metadata, forward and greedy sampling.
  - ours (forward): the bare `LlamaModel.forward` on the same inputs (metadata built outside the timer).
  - HF: `model(input_ids[B, 1], cache=DynamicCache of C tokens, use_cache=True)` plus the argmax.
  The sequences are prefilled once, through StepPlans, with max(B) random prompts of C tokens; smaller
  batches use the first B of them. HF's DynamicCache is filled with the K/V our prefill wrote (HF caches the
  same post-rope K/V), which saves a second prefill and lets us check that both pick the same tokens.
  Context stays C: after each of our steps the requests are rewound (token list, num_computed_tokens:
  the new KV slot is simply rewritten next time); HF's cache is cropped back after each step.
* prefill N: one NEW request with N prompt tokens scheduled at once (ours, via execute; it samples its
  first token and finishes) against HF's forward over [1, N] with a fresh DynamicCache and
  `logits_to_keep=1` (as `generate` does; ours also computes the last row's logits only).

Runs of ours and HF are interleaved (the order rotates each repetition) and the table shows medians, because a
shared machine is noisy. tokens/s = tokens produced (decode: B; prefill: N) / median seconds.

    .venv/bin/python -m experiments.worker_forward                      # all cores, B = 1 8 32 64, C = 256
    .venv/bin/python -m experiments.worker_forward --threads 1 --repeats 9 --json /tmp/wf.json
    .venv/bin/python -m experiments.worker_forward --profile 32,64       # + where our decode step spends its time
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

# Must be set before torch loads OpenMP. With the default (active) policy, threads that finish early spin at
# every barrier; on a shared, oversubscribed box a descheduled sibling then makes each parallel op wait a
# whole time slice (measured: 2 threads 20x slower than 1 on this 2-core machine under load). Passive waiting
# affects ours and HF alike. Set OMP_WAIT_POLICY=ACTIVE to measure the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

import kernels
from protos import worker_pb2 as pb
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.loader import default_model_path
from worker_svc.server import execute_step

BLOCK_SIZE = 16
PREFILL_STEP_TOKENS = 2048  # setup prefill: sequences per step so that a step holds at most this many tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch.set_num_threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per case and implementation")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--batch-sizes", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=256, help="cached tokens per sequence for decode")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill case (0: skip)")
    p.add_argument("--profile", default="", help="decode batch sizes to profile ours at, comma-separated (e.g. 32,64)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    args.profile = sorted({int(b) for b in args.profile.split(",") if b.strip()})
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.context < 1 or args.repeats < 1:
        p.error("need batch sizes >= 1, --context >= 1 and --repeats >= 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timer:
    """Wall and process-CPU seconds of each call, per name."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def run(self, name: str, fn: Callable[[], object], record: bool = True) -> object:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        t1, c1 = time.perf_counter(), time.process_time()
        if record:
            self.wall[name].append(t1 - t0)
            self.cpu[name].append(c1 - c0)
        return out


def interleaved(timer: Timer, fns: dict[str, Callable[[], object]], repeats: int, warmup: int,
                between: Callable[[str], None] | None = None) -> None:
    """Run every fn warmup + repeats times, rotating the order each round; `between(name)` runs untimed after
    each call (resetting state)."""
    names = list(fns)
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            timer.run(name, fns[name], record=r >= warmup)
            if between is not None:
                between(name)


# ------------------------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, model_path: str, num_blocks: int):
        self.runner = ModelRunner(WorkerConfig(model=model_path, device="cpu", dtype="float32",
                                                num_gpu_blocks_override=num_blocks))
        self.step_id = 0
        self.slot_of: dict[str, int] = {}  # the worker protocol addresses requests by slot
        self.next_block = 0
        self.backend = getattr(self.runner, "attention_backend", "torch")
        self.prefill_blocks: list[int] = []

    def plan(self) -> pb.StepPlan:
        self.step_id += 1
        return pb.StepPlan(step_id=self.step_id)

    def blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        if self.next_block > self.runner.num_blocks:
            raise RuntimeError("KV pool too small for the benchmark")
        return out

    def prefill_sequences(self, prompts: list[list[int]], context: int) -> list[str]:
        """NEW requests for every prompt, prefilled through StepPlans; each ends with C computed tokens and
        one sampled (not yet computed) token."""
        per_step = max(1, PREFILL_STEP_TOKENS // context)
        blocks_each = -(-(context + 1) // BLOCK_SIZE)  # room for the decode token
        sampling = pb.SamplingParams(temperature=0.0, ignore_eos=True)
        ids = []
        for start in range(0, len(prompts), per_step):
            plan = self.plan()
            for i in range(start, min(len(prompts), start + per_step)):
                rid = f"seq-{i}"
                slot = self.slot_of.setdefault(rid, len(self.slot_of))
                plan.new_requests.add(slot=slot, request_id=rid, prompt_token_ids=prompts[i], sampling=sampling,
                                      block_ids=self.blocks(blocks_each), num_scheduled_tokens=context)
                ids.append(rid)
            res = execute_step(self.runner, plan)
            assert len(res.slots) == len(plan.new_requests), res
        return ids

    def rows(self, rids: list[str]) -> list[int]:
        return [self.runner.batch.inputs.row_of[r] for r in rids]

    def block_ids(self, rids: list[str]) -> list[list[int]]:
        b = self.runner.batch.inputs
        return [b.block_table[r, : b.num_blocks[r]].tolist() for r in self.rows(rids)]

    def decode_plan(self, rids: list[str]) -> pb.StepPlan:
        plan = self.plan()
        plan.cached.slots.extend(self.slot_of[rid] for rid in rids)
        plan.cached.num_scheduled_tokens.extend([1] * len(rids))
        return plan

    def decode_step(self, rids: list[str]) -> list[int]:
        return list(execute_step(self.runner, self.decode_plan(rids)).token_ids)

    def rewind(self, rids: list[str], context: int) -> None:
        """Back to C computed tokens + the token to decode: the next step recomputes the same position."""
        rows = self.rows(rids)
        self.runner.batch.inputs.num_tokens[rows] = context + 1
        self.runner.batch.inputs.num_computed_tokens[rows] = context

    def forward_inputs(self, rids: list[str], context: int):
        r = self.runner
        n = len(rids)
        meta = kernels.build_attention_metadata([1] * n, [context + 1] * n, self.block_ids(rids),
                                                r.block_size, r.device, build_plan=self.backend == "torch")
        ids = torch.from_numpy(r.batch.inputs.token_ids[self.rows(rids), context]).to(torch.int64)
        pos = torch.full((n,), context, dtype=torch.int64)
        return ids, pos, meta, torch.arange(n)

    def forward(self, inputs) -> torch.Tensor:
        ids, pos, meta, rows = inputs
        return self.runner.model.forward(ids, pos, self.runner.kv, meta, rows).argmax(-1)

    def prefill(self, prompt: list[int], rid: str) -> int:
        plan = self.plan()
        # max_tokens=1: the request finishes with its first token and leaves the batch (its blocks are reused).
        plan.new_requests.add(slot=len(self.slot_of), request_id=rid, prompt_token_ids=prompt,  # freed at once
                              sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1),
                              block_ids=self.prefill_blocks, num_scheduled_tokens=len(prompt))
        res = execute_step(self.runner, plan)
        assert len(res.slots) == 1 and rid not in self.runner.batch.inputs.row_of
        return res.token_ids[0]

    def hf_cache_tensors(self, rids: list[str], context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) as [B, Hkv, C, D], read from our paged pool."""
        cfg = self.runner.config
        table = torch.tensor(self.block_ids(rids), dtype=torch.int64)
        out = []
        for layer in range(cfg.num_layers):
            kv = []
            for which in (0, 1):
                x = self.runner.kv[layer, which][table]  # [B, blocks, block, Hkv, D]
                x = x.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                kv.append(x)
            out.append((kv[0], kv[1]))
        return out


# -------------------------------------------------------------------------------------------- HF


class HF:
    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM, DynamicCache
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        directory, name = os.path.split(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        self.DynamicCache = DynamicCache
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renamed it
        self.cache = None

    def set_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache = self.DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        self.cache = cache

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens[:, None], use_cache=True, **{self.cache_kw: self.cache})
        return out.logits[:, -1].argmax(-1)

    def crop(self, context: int) -> None:
        extra = self.cache.get_seq_length() - context
        if extra > 0:
            self.cache.crop(-extra)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        cache = self.DynamicCache(config=self.model.config)
        out = self.model(prompt[None], use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[:, -1].argmax(-1)


# ------------------------------------------------------------------------------------- profiling

_CATEGORIES = [
    ("matmul (linear / lm_head)", ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm",
                                   "aten::matmul", "aten::linear")),
    ("attention: SDPA kernel", ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
                                "aten::_softmax")),
    ("attention: K/V gather from pages", ("aten::index_select", "aten::index_fill_")),
    ("attention: KV cache write", ("aten::index_copy_",)),
    ("norms / rope / SiLU / residual", ("aten::_fused_rms_norm", "aten::mul", "aten::mul_", "aten::add", "aten::add_",
                                        "aten::silu", "aten::silu_", "aten::flip", "aten::embedding", "aten::index",
                                        "aten::rsqrt", "aten::pow", "aten::mean", "aten::cat", "aten::neg",
                                        "aten::rms_norm", "aten::sum", "aten::div_", "aten::type_as")),
    ("argmax / sampling ops", ("aten::argmax", "aten::max", "aten::log_softmax")),
]


def profile_decode(ours: Ours, rids: list[str], context: int, steps: int) -> dict:
    """Phase times of `execute` (metadata timed by wrapping the function the runner calls, sampling as the step
    reports it) and torch-op self time by category, over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    phase = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phase[name] += time.perf_counter() - t
        return wrapper

    orig_meta = kernels.attention_metadata_from_arrays
    kernels.attention_metadata_from_arrays = timed("metadata", orig_meta)
    try:
        ours.decode_step(rids)  # warm
        ours.rewind(rids, context)
        phase.clear()
        wall = forward = 0.0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                t = time.perf_counter()
                res = execute_step(ours.runner, ours.decode_plan(rids))
                wall += time.perf_counter() - t
                forward += res.forward_seconds
                phase["sampling"] += res.sample_seconds
                ours.rewind(rids, context)
    finally:
        kernels.attention_metadata_from_arrays = orig_meta

    # self CPU time of the ops that ran inside the forward (sampling ops are counted there too: small)
    by_cat: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        cat = next((c for c, names in _CATEGORIES if ev.key in names), "other torch ops")
        by_cat[cat] += ev.self_cpu_time_total / 1e6
    ops_total = sum(by_cat.values())
    per_step = {k: v / steps for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    rest = wall - forward - phase["metadata"] - phase["sampling"]
    return {
        "batch": len(rids), "steps": steps,
        "step_ms": 1e3 * wall / steps,
        "phases_ms": {
            "forward": 1e3 * forward / steps,
            "attention metadata (attention_metadata_from_arrays)": 1e3 * phase["metadata"] / steps,
            "sampling (the step's sample_seconds)": 1e3 * phase["sampling"] / steps,
            "plan check/apply, input tensors, bookkeeping": 1e3 * rest / steps,
        },
        "ops_ms": {k: 1e3 * v for k, v in per_step.items()},
        "python_and_dispatch_ms": 1e3 * (wall - ops_total) / steps,
    }


# ------------------------------------------------------------------------------------------ main


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    t_start = time.perf_counter()

    max_b = max(args.batch_sizes + args.profile)
    blocks_each = -(-(args.context + 1) // BLOCK_SIZE)
    prefill_blocks = -(-args.prefill_tokens // BLOCK_SIZE)
    log(f"loading our runner and HF model ({model_path}) ...")
    ours = Ours(model_path, max_b * blocks_each + prefill_blocks + 1)
    hf = HF(model_path)
    vocab = ours.runner.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, vocab, (max_b, args.context), generator=gen).tolist()

    t = time.perf_counter()
    log(f"prefilling {max_b} sequences of {args.context} tokens through StepPlans ...")
    all_rids = ours.prefill_sequences(prompts, args.context)
    setup_s = time.perf_counter() - t
    log(f"  {setup_s:.1f}s")

    timer = Timer()
    results = []
    for b in args.batch_sizes:
        log(f"decode B={b} ...")
        results.append(bench_decode(ours, hf, timer, all_rids[:b], args))
    if args.prefill_tokens > 0:
        log(f"prefill {args.prefill_tokens} ...")
        ours.prefill_blocks = ours.blocks(prefill_blocks)
        prompt = torch.randint(3, vocab, (args.prefill_tokens,), generator=gen)
        results.append(bench_prefill(ours, hf, timer, prompt, args))

    profiles = []
    for b in args.profile:
        log(f"profiling ours, decode B={b} ...")
        profiles.append(profile_decode(ours, all_rids[:b], args.context, args.profile_steps))

    total_s = time.perf_counter() - t_start
    meta = {
        "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup, "context": args.context,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "load_avg": os.getloadavg(), "setup_prefill_s": setup_s, "total_s": total_s,
        "model": os.path.basename(model_path), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    print(render(results, meta))
    for prof in profiles:
        print(render_profile(prof))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "profiles": profiles, "raw_wall_s": timer.wall,
                       "raw_cpu_s": timer.cpu}, f, indent=1)
        log(f"wrote {args.json}")
    return 0


def bench_decode(ours: Ours, hf: HF, timer: Timer, rids: list[str], args: argparse.Namespace) -> dict:
    b, context = len(rids), args.context
    hf.set_cache(ours.hf_cache_tensors(rids, context))
    tokens = torch.from_numpy(ours.runner.batch.inputs.token_ids[ours.rows(rids), context]).to(torch.int64)
    inputs = ours.forward_inputs(rids, context)
    picked: dict[str, list[int]] = {}

    def run_exec():
        picked["ours"] = ours.decode_step(rids)

    def run_hf():
        picked["hf"] = hf.decode(tokens).tolist()

    def reset(name: str) -> None:
        if name.endswith("ours_execute"):
            ours.rewind(rids, context)
        elif name.endswith("hf"):
            hf.crop(context)

    fns = {f"decode{b}/ours_execute": run_exec, f"decode{b}/ours_forward": lambda: ours.forward(inputs),
           f"decode{b}/hf": run_hf}
    interleaved(timer, fns, args.repeats, args.warmup, between=reset)
    hf.cache = None
    agree = sum(x == y for x, y in zip(picked["ours"], picked["hf"], strict=True)) / b
    return summarize(timer, f"decode{b}", f"decode B={b}, ctx {context}", b, agree)


def bench_prefill(ours: Ours, hf: HF, timer: Timer, prompt: torch.Tensor, args: argparse.Namespace) -> dict:
    n = len(prompt)
    prompt_list = prompt.tolist()
    picked: dict[str, list[int]] = {}
    counter = iter(range(1 << 62))

    def run_ours():
        picked["ours"] = [ours.prefill(prompt_list, f"prefill-{next(counter)}")]

    def run_hf():
        picked["hf"] = hf.prefill(prompt).tolist()

    interleaved(timer, {"prefill/ours_execute": run_ours, "prefill/hf": run_hf}, args.repeats, args.warmup)
    return summarize(timer, "prefill", f"prefill {n} tokens", n, float(picked["ours"] == picked["hf"]))


def summarize(timer: Timer, key: str, label: str, tokens: int, agree: float) -> dict:
    row = {"case": label, "tokens": tokens, "argmax_agreement": agree}
    for impl in ("ours_execute", "ours_forward", "hf"):
        wall = timer.wall.get(f"{key}/{impl}")
        if not wall:
            continue
        s = med(wall)
        row[impl] = {"median_s": s, "min_s": min(wall), "median_cpu_s": med(timer.cpu[f"{key}/{impl}"]),
                     "tokens_per_s": tokens / s}
    hf_tps = row["hf"]["tokens_per_s"]
    for impl in ("ours_execute", "ours_forward"):
        if impl in row:
            row[f"ratio_{impl}_vs_hf"] = row[impl]["tokens_per_s"] / hf_tps
    return row


def render(results: list[dict], meta: dict) -> str:
    def cell(row, impl):
        if impl not in row:
            return "-"
        r = row[impl]
        return f"{r['tokens_per_s']:,.0f} ({1e3 * r['median_s']:.1f} ms)"

    lines = [
        f"### Worker forward vs HF transformers ({meta['model']}, fp32, {meta['threads']} threads, "
        f"OMP_WAIT_POLICY={meta['omp_wait_policy']}, median of {meta['repeats']})",
        "",
        "| case | ours execute tok/s | ours forward tok/s | HF tok/s | execute / HF | forward / HF "
        "| execute / HF, CPU time | same argmax |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        fwd = row.get("ratio_ours_forward_vs_hf")
        lines.append(
            f"| {row['case']} | {cell(row, 'ours_execute')} | {cell(row, 'ours_forward')} | {cell(row, 'hf')} | "
            f"{row['ratio_ours_execute_vs_hf']:.2f} | {'-' if fwd is None else f'{fwd:.2f}'} | "
            f"{row['hf']['median_cpu_s'] / row['ours_execute']['median_cpu_s']:.2f} | "
            f"{100 * row['argmax_agreement']:.0f}% |")
    lines += ["", f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpu_count']} CPUs, "
              f"load average {meta['load_avg'][0]:.1f} at the end; setup prefill {meta['setup_prefill_s']:.0f}s, "
              f"total {meta['total_s']:.0f}s"]
    return "\n".join(lines)


def render_profile(p: dict) -> str:
    lines = ["", f"#### Profile: ours, decode B={p['batch']} ({p['steps']} steps, {p['step_ms']:.1f} ms/step under "
             f"the profiler)", "", "| phase of `execute` | ms/step |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in p["phases_ms"].items()]
    lines += ["", "| torch ops (self time) | ms/step |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in p["ops_ms"].items()]
    lines += [f"| Python + dispatch (step wall - op self time) | {p['python_and_dispatch_ms']:.1f} |"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
