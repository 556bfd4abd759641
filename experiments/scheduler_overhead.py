"""Scheduler overhead per iteration: step wall time minus the worker's reported execute time.

Runs the real stack -- a private redis-server, a worker process serving a 2-layer random-weight Llama (so the
model costs little), and the scheduler (driver + gRPC server) in this process, built the way
`llmserve serve` builds it (`llmserve/serve.py`) -- and streams N concurrent requests from a separate client
process (so client work does not share the scheduler's GIL). Only steady-state decode steps (every request
running, one token each) are measured, from `driver.step_stats`:

    overhead = wall - worker      wall   = schedule + plan + ExecuteStep RPC + token bookkeeping + Redis commit
                                  worker = the worker's prepare + forward + sample seconds

The overhead is split by timing wrappers installed around the driver's pieces (policy, plan build, the RPC, the
commit; "other" is the rest of the step: token bookkeeping and metrics), and the driver thread's CPU time per
iteration is reported beside it (steadier than wall time on a shared machine), and so is the whole scheduler
process's CPU time per generated token (driver, the gRPC API's event loop, every stream). Redis cost per step
comes from the server's own counters over the measured window: `INFO commandstats` (calls, script time) and
`INFO stats` (bytes).
`--direct` submits straight to the driver with no gRPC streams: the loop without the API layer.

    .venv/bin/python -m experiments.scheduler_overhead --repeats 3              # N = 16, 64, 256, median of 3 runs
    .venv/bin/python -m experiments.scheduler_overhead --repeats 3 --direct     # the loop alone
    .venv/bin/python -m experiments.scheduler_overhead --running 256 --profile  # + cProfile of the driver thread
    .venv/bin/python -m experiments.scheduler_overhead --running 2 --warmup 2 --measure 5 --tail-tokens 16  # smoke
    .venv/bin/python -m experiments.scheduler_overhead --model PATH.gguf --worker-args '--quantization gguf' \
        --running 1 --prompt-len 128 --warmup 10 --measure 100 --tail-tokens 40   # a real model: the low-load gap

Results and how to read them: experiments/SCHEDULER.md.

Run it from the repository root (`python -m experiments.NAME`: experiments/ is a package). The module also holds
the pieces `experiments/serve_throughput.py` and `experiments/tracing_overhead.py` reuse: `Stack` and the streaming
client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from llmserve.bench.metrics import percentile
from tests.support.stack import Stack as HarnessStack

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------------ helpers


def make_tiny_llama(path: str, *, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2,
                    max_position_embeddings: int = 4096, seed: int = 0) -> str:
    """A random-weight Llama saved as an HF directory (config.json + safetensors), as tests/e2e/test_model.py does."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, vocab_size)
    return path


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer.json whose vocabulary is exactly the model's ("t0" .. "tN-1", one word each), so the scheduler
    can detokenize every id the random model emits (a larger one is refused at start: ids it cannot embed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(path, "tokenizer.json"))


class Stack(HarnessStack):
    """redis-server + worker process + in-process scheduler (driver + gRPC server), like `llmserve serve`
    (`tests.support.stack.Stack`), with the attributes the instrumentation below reads."""

    def __init__(self, model: str, *, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                 num_blocks: int | None,
                 max_model_len: int | None, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", block_size: int = 16, extra_scheduler_args: list[str] | None = None,
                 worker_otlp_endpoint: str | None = None, extra_worker_args: list[str] | None = None):
        worker = ["--model", model, "--dtype", dtype, "--device", device, "--block-size", str(block_size),
                  *(extra_worker_args or [])]
        if num_blocks is not None:
            worker += ["--num-gpu-blocks-override", str(num_blocks)]
        if max_model_len is not None:
            worker += ["--max-model-len", str(max_model_len)]
        if worker_otlp_endpoint:  # the worker traces to this collector (None: off)
            worker += ["--otlp-traces-endpoint", worker_otlp_endpoint]
        scheduler = list(extra_scheduler_args or [])
        # None: the scheduler's own default, sized for the worker's device (as `llmserve serve` does).
        if max_num_seqs is not None:
            scheduler += ["--max-num-seqs", str(max_num_seqs)]
        if max_num_batched_tokens is not None:
            scheduler += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if tokenizer:
            scheduler += ["--tokenizer", tokenizer]
        super().__init__(worker, scheduler)

    def start(self) -> Stack:
        import redis

        super().start()
        self.procs = [self.redis_server, self.worker]
        self.redis = redis.Redis.from_url(self.redis_url)
        self.ledger, self.server, self.port = self.scheduler.ledger, self.scheduler.server, self.scheduler.port
        return self

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.driver.core is not None and (self.driver.core.has_work or self.driver.in_flight is not None) \
                and time.monotonic() < deadline:
            time.sleep(0.05)


# --------------------------------------------------------------------------------------- streaming client
#
# Runs in its own process (`python -m experiments.scheduler_overhead --client SPEC OUT`): N concurrent Generate
# streams over one common.client channel. Records, per request, the submit time and each streamed message's arrival
# time and token count (time.perf_counter: CLOCK_MONOTONIC, comparable across processes on Linux).


async def _client_main(spec: dict) -> list[dict]:
    from common.client import Client
    from protos import llmserve_pb2 as pb

    async with Client(spec["address"]) as client:

        async def one(i: int, prompt: list[int]) -> dict:
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
            # No client request id: with one, every Generate first looks the id up (in Redis when it is not in
            # memory), which is admission cost, not the loop's -- and 256 concurrent lookups can exhaust the
            # scheduler's Redis connection pool (redis-py's default is 100 connections).
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
            t_submit = time.perf_counter()
            events: list[tuple[float, int]] = []
            token_ids: list[int] = []
            finish = ""
            async for msg in client.generate(req):
                if msg.token_ids:
                    events.append((time.perf_counter(), len(msg.token_ids)))
                    token_ids.extend(msg.token_ids)
                if msg.finish_reason:
                    finish = msg.finish_reason
            return {"submit": t_submit, "events": events, "token_ids": token_ids, "finish": finish,
                    "end": time.perf_counter()}

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(spec["prompts"])))


def client_main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    results = asyncio.run(_client_main(spec))
    with open(out_path, "w") as f:
        json.dump(results, f)


def start_clients(address: str, prompts: list[list[int]], max_tokens: int, tag: str,
                  workdir: str) -> tuple[subprocess.Popen, str]:
    """Start the client process; returns it and the path its results will be written to."""
    spec_path = os.path.join(workdir, f"client-{tag}.json")
    out_path = os.path.join(workdir, f"client-{tag}.out.json")
    with open(spec_path, "w") as f:
        json.dump({"address": address, "prompts": prompts, "max_tokens": max_tokens, "tag": tag}, f)
    proc = subprocess.Popen([sys.executable, "-m", "experiments.scheduler_overhead", "--client", spec_path, out_path],
                            cwd=REPO)
    return proc, out_path


def finish_clients(proc: subprocess.Popen, out_path: str, timeout: float) -> list[dict]:
    rc = proc.wait(timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"the client process exited with code {rc}")
    with open(out_path) as f:
        return json.load(f)


def client_latencies(results: list[dict]) -> tuple[list[float], list[float]]:
    """TTFT per request and ITL per token (a message carrying k tokens counts its gap k times, split evenly)."""
    ttft, itl = [], []
    for r in results:
        ev = r["events"]
        if not ev:
            continue
        ttft.append(ev[0][0] - r["submit"])
        for (t_prev, _), (t, k) in zip(ev, ev[1:], strict=False):
            itl.extend([(t - t_prev) / k] * k)
    return ttft, itl


# ----------------------------------------------------------------------------------------- instrumentation


class Probe:
    """Timing wrappers around the driver's pieces; one record per ExecuteStep call, in step order."""

    def __init__(self, driver):
        import scheduler_svc.core.scheduler as core_mod
        import scheduler_svc.driver.driver as driver_mod

        self.driver = driver
        self.records: list[dict] = []
        self.iterations: list[tuple[float, float, float]] = []  # (start, end, driver-thread CPU) per _iteration
        self.payloads: dict[int, int] = {}  # step id -> bytes of its commit payload
        self._last: dict = {}
        self.profiler: cProfile.Profile | None = None
        self.profile_window = threading.Event()  # set: profile the iterations that start while set
        self._profiling = False
        self.after_iteration = None  # called in the driver thread after each iteration (run_level's WindowEdge)

        orig_schedule, orig_encode = core_mod.schedule, driver_mod.encode_plan

        def schedule(*a, **kw):
            t = time.perf_counter()
            out = orig_schedule(*a, **kw)
            self._last = {"schedule": time.perf_counter() - t}
            return out

        def encode_plan(*a, **kw):
            t = time.perf_counter()
            plan = orig_encode(*a, **kw)
            self._last["plan"] = time.perf_counter() - t
            return plan

        core_mod.schedule, driver_mod.encode_plan = schedule, encode_plan

        def restore() -> None:
            core_mod.schedule, driver_mod.encode_plan = orig_schedule, orig_encode

        self._restore = restore
        orig_iteration = driver._iteration

        def iteration():
            prof = self.profiler if self.profile_window.is_set() else None
            t, c = time.perf_counter(), time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                orig_iteration()
            finally:
                if prof is not None:
                    prof.disable()
                self.iterations.append((t, time.perf_counter(), time.thread_time() - c))
            hook = self.after_iteration
            if hook is not None:
                hook()

        driver._iteration = iteration

        ledger = driver.ledger
        orig_commit_script = ledger._commit
        self.commit_sha = orig_commit_script.sha  # to pick its calls out of the server's SLOWLOG

        def commit_script(keys=None, args=None, client=None):
            # Every ARGV as sent: bytes as they are, the rest as its text.
            self.payloads[self.driver.step_id] = sum(len(a) if isinstance(a, bytes) else len(str(a).encode())
                                                     for a in args or ())
            return orig_commit_script(keys=keys, args=args, client=client)

        ledger._commit = commit_script

    def wrap_worker(self) -> None:
        """Call once the driver holds its worker stub (after `ready`): time each ExecuteStep from send to result."""
        stub = self.driver.worker.stub
        probe, orig = self, stub.ExecuteStep

        class Timed:
            def future(self, plan, **kw):
                t, c = time.perf_counter(), time.thread_time()
                fut = orig.future(plan, **kw)
                rec = dict(probe._last)
                rec.update(send_cpu=time.thread_time() - c, plan_bytes=plan.ByteSize(), step_id=plan.step_id)

                class Result:
                    def result(self, timeout=None):
                        result = fut.result(timeout=timeout)
                        worker = result.prepare_seconds + result.forward_seconds + result.sample_seconds
                        rec.update(rpc=time.perf_counter() - t, rpc_cpu=rec["send_cpu"], worker=worker,
                                   result_bytes=result.ByteSize())
                        probe.records.append(rec)
                        return result

                return Result()

        stub.ExecuteStep = Timed()

    def close(self) -> None:
        self._restore()


def script_times_start(client) -> None:
    """Log every command's execution time (the server's SLOWLOG, threshold 0) for the measured window."""
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 1_000_000)
    client.slowlog_reset()


def script_times_end(client, sha: str) -> list[float]:
    """Milliseconds of each call of script `sha` (its EVALSHA, inner commands included) since the start."""
    entries = client.slowlog_get(1_000_000)
    client.config_set("slowlog-log-slower-than", 10_000)
    client.slowlog_reset()
    ms = []
    for e in entries:
        cmd = e["command"]
        cmd = cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)
        if cmd.lower().startswith("evalsha") and sha in cmd:
            ms.append(e["duration"] / 1e3)
    return ms


def redis_counters(client) -> dict:
    cmd = client.info("commandstats")
    stats = client.info("stats")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmd.items()}
    usec = {k.removeprefix("cmdstat_"): v["usec"] for k, v in cmd.items()}
    return {"calls": calls, "usec": usec, "in": stats["total_net_input_bytes"], "out": stats["total_net_output_bytes"]}


# --------------------------------------------------------------------------------------------- one run


class DirectClients:
    """`--direct`: hand Requests straight to `driver.submit` (admission as the API does it) with no gRPC streams,
    so the loop is measured without the API layer's stream threads competing for this process's GIL."""

    def __init__(self, stack: Stack, prompts: list[list[int]], max_tokens: int, tag: str):
        from protos import llmserve_pb2 as pb
        from scheduler_svc.driver import admission

        self.driver = stack.driver
        info = self.driver.worker_info
        limits = admission.Limits(max_model_len=info.max_model_len, vocab_size=info.model.vocab_size,
                        kv_pool_tokens=info.num_blocks * info.block_size, block_size=info.block_size)
        self.rids = []
        for ids in prompts:
            g = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            rid = os.urandom(16).hex()  # the shape of the ids the API assigns (uuid4 hex)
            if hasattr(admission, "build_requests"):  # the API's own admission path, as its Generate calls it
                self.driver.submit(admission.build_requests(g, ids, limits, rid))
            else:
                self.driver.submit(admission.build_request(g, ids, limits, rid, list(info.model.eos_token_ids)))
            self.rids.append(rid)
        self.returncode = None

    def poll(self):
        return None

    def terminate(self) -> None:
        for rid in self.rids:
            self.driver.abort(rid)

    def wait(self, timeout: float | None = None) -> int:
        return 0


class WindowEdge:
    """Holds the driver thread between two iterations once `count` steady steps (all N running, one token each) at
    step index `start` or later have been committed, until `release()`, so that run_level reads a window edge (step
    index, Redis counters, clocks) with no step committed past it. Polling from the benchmark thread instead lands
    the edge an unknown number of steps late (a step takes a few ms; a poll, or a GIL hand-over on a busy machine,
    longer), so the window could hold none of the steps waited for, or the requests run out of tokens first."""

    def __init__(self, probe: Probe, n: int):
        self.probe, self.stats, self.n = probe, probe.driver.step_stats, n
        self.reached, self.resume = threading.Event(), threading.Event()
        self.target: int | None = None
        self.seen = self.count = 0
        probe.after_iteration = self

    def arm(self, start: int, count: int) -> None:
        """Call while the driver is held (or before the requests start)."""
        self.seen, self.count = start, 0
        self.reached.clear()
        self.target = count  # last: the driver thread tests it first

    def __call__(self) -> None:  # the driver thread, after each iteration (it commits one step at most)
        if self.target is None:
            return
        stats, end = self.stats, len(self.stats)
        self.count += sum(1 for i in range(self.seen, end) if stats[i].running == self.n and stats[i].tokens == self.n)
        self.seen = max(self.seen, end)
        if self.count >= self.target:
            self.target = None
            self.resume.clear()
            self.reached.set()
            self.resume.wait(60)  # bounded: a benchmark thread that died must not stall the driver for good

    def release(self) -> None:
        self.resume.set()

    def close(self) -> None:
        self.probe.after_iteration, self.target = None, None
        self.resume.set()


def run_level(stack: Stack, probe: Probe, n: int, *, prompt_len: int, warmup: int, measure: int, vocab: int,
              seed: int, profile: bool, tail_tokens: int, direct: bool = False) -> dict:
    driver = stack.driver
    rng = random.Random(seed + n)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]
    # Requests reach the driver over several steps (client start-up, per-request admission), so all N run together
    # only once the last has arrived. The window's edges are exact in steps (WindowEdge), so each request needs
    # warmup + measure tokens, one for the step skipped after the first edge and one for the step in flight at the
    # second; the tail covers that and the arrival spread. The clients are cancelled once the window closes (their
    # blocks are freed at the next iteration boundary).
    max_tokens = warmup + measure + tail_tokens
    base_stats = len(driver.step_stats)
    base_rec = len(probe.records)
    edge = WindowEdge(probe, n)
    edge.arm(base_stats, warmup)  # before the requests start
    # Fresh request ids each run: a known id would re-attach to the earlier (finished) request.
    tag = f"n{n}-{os.urandom(4).hex()}"
    if direct:
        proc = DirectClients(stack, prompts, max_tokens, tag)
    else:
        proc, _ = start_clients(stack.address, prompts, max_tokens, tag, stack.workdir)

    def wait_edge(count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not edge.reached.wait(0.02):
            if not driver.ready.is_set():
                raise RuntimeError(f"the driver stepped down at N={n} (see its log above)")
            if proc.poll() is not None:
                raise RuntimeError(f"clients ended (rc={proc.returncode}) before {count} steady steps at N={n} "
                                   f"(max_tokens {max_tokens}: raise --tail-tokens?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {count} steady steps at N={n}")

    try:
        wait_edge(warmup)  # the driver is held from here to release(): no step is committed meanwhile
        script_times_start(stack.redis)
        a_idx, a_red, a_it = len(driver.step_stats), redis_counters(stack.redis), len(probe.iterations)
        if profile:
            # Engine-thread CPU time, not wall: waits (GIL, locks, sockets) on a shared machine would swamp it.
            probe.profiler = cProfile.Profile(time.thread_time)
            probe.profile_window.set()
        t_a, cpu_a = time.perf_counter(), time.process_time()
        # Pipelined, step a_idx was sent before the hold, so its wall time includes the hold: the `measure` steady
        # steps are counted after it.
        edge.arm(a_idx + 1, measure)
        edge.release()
        wait_edge(measure)
        t_b, cpu_b = time.perf_counter(), time.process_time()
        probe.profile_window.clear()
        b_idx, b_red, b_it = len(driver.step_stats), redis_counters(stack.redis), len(probe.iterations)
        commit_script_ms = script_times_end(stack.redis, probe.commit_sha)
    finally:
        edge.close()
    proc.terminate()
    proc.wait(timeout=30)
    stack.wait_idle()

    deadline = time.monotonic() + 5  # pipelined: the last step's commit may still be under way
    while len(probe.records) - base_rec != len(driver.step_stats) - base_stats and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = list(driver.step_stats)
    recs = probe.records[base_rec:]
    if len(recs) != len(stats) - base_stats:
        raise RuntimeError(f"probe saw {len(recs)} steps, the driver {len(stats) - base_stats}")
    window = [(s, recs[i - base_stats]) for i, s in enumerate(stats[a_idx + 1:b_idx], start=a_idx + 1)
              if s.running == n and s.tokens == n]
    if len(window) < max(measure, 1):
        raise RuntimeError(f"the window (steps {a_idx + 1} to {b_idx}) holds {len(window)} steady steps at N={n}, "
                           f"not {measure}")
    steps = b_idx - a_idx
    over = [(s.wall - s.worker) * 1e3 for s, _ in window]
    split = {
        "policy": [r["schedule"] * 1e3 for _, r in window],
        "plan": [r["plan"] * 1e3 for _, r in window],
        "rpc_minus_worker": [(r["rpc"] - r["worker"]) * 1e3 for _, r in window],
        "commit": [s.commit * 1e3 for s, _ in window],
    }
    split["other"] = [o - sum(split[k][i] for k in ("policy", "plan", "rpc_minus_worker", "commit"))
                      for i, o in enumerate(over)]
    # Whole-loop view: one `_iteration` call = drain inbox + the step + publishing to the streams + metrics.
    its = probe.iterations[a_it:b_it]
    loop_period = percentile([(it[1] - it[0]) * 1e3 for it in its], 50)
    # Engine-thread CPU (time.thread_time): what the scheduler itself spends, without the waits that CPU
    # contention on a shared machine adds to wall time.
    engine_cpu = [it[2] * 1e3 for it in its]
    rpc_cpu = [r["rpc_cpu"] * 1e3 for _, r in window]
    evalsha_usec = b_red["usec"].get("evalsha", 0) - a_red["usec"].get("evalsha", 0)
    delta_calls = {k: b_red["calls"].get(k, 0) - a_red["calls"].get(k, 0) for k in b_red["calls"]}
    # Our own two INFO calls per snapshot are not the scheduler's.
    for ours in ("info", "config|set", "config", "slowlog|get", "slowlog|reset", "slowlog"):
        delta_calls.pop(ours, None)
    evalsha = delta_calls.get("evalsha", 0)
    total_cmds = sum(delta_calls.values())
    out = {
        "running": n,
        "steps": steps,
        "steady_steps": len(window),
        "overhead_p50_ms": percentile(over, 50),
        "overhead_p99_ms": percentile(over, 99),
        "wall_p50_ms": percentile([s.wall * 1e3 for s, _ in window], 50),
        "worker_p50_ms": percentile([s.worker * 1e3 for s, _ in window], 50),
        "loop_period_ms": loop_period,
        "split_p50_ms": {k: percentile(v, 50) for k, v in split.items()},
        "evalsha_per_step": evalsha / steps if steps else float("nan"),
        "redis_cmds_per_step": total_cmds / steps if steps else float("nan"),
        "redis_in_bytes_per_step": (b_red["in"] - a_red["in"]) / steps if steps else float("nan"),
        "redis_out_bytes_per_step": (b_red["out"] - a_red["out"]) / steps if steps else float("nan"),
        "commit_payload_bytes": percentile([probe.payloads.get(r["step_id"], 0) for _, r in window], 50),
        "engine_cpu_p50_ms": percentile(engine_cpu, 50),
        "rpc_cpu_p50_ms": percentile(rpc_cpu, 50),
        "redis_evalsha_ms": evalsha_usec / 1e3 / evalsha if evalsha else float("nan"),
        "commit_script_p50_ms": percentile(commit_script_ms, 50) if commit_script_ms else float("nan"),
        "commit_p50_ms": percentile(split["commit"], 50),
        "plan_bytes_p50": percentile([r["plan_bytes"] for _, r in window], 50),
        "result_bytes_p50": percentile([r["result_bytes"] for _, r in window], 50),
        "steps_per_s": steps / (t_b - t_a),
        # The pipeline view (issue: the worker never waits). Gap = the worker's time between the end of one forward
        # and the start of the next: the previous step's sampling + idle (no plan yet) + this step's input building.
        "worker_gap_p50_ms": percentile([(stats[i - 1].sample + s.idle + s.prepare) * 1e3
                                         for i, s in enumerate(stats[a_idx:b_idx], start=a_idx) if i > 0], 50),
        "worker_idle_p50_ms": percentile([s.idle * 1e3 for s in stats[a_idx:b_idx]], 50),
        "worker_prepare_p50_ms": percentile([s.prepare * 1e3 for s in stats[a_idx:b_idx]], 50),
        "worker_sample_p50_ms": percentile([s.sample * 1e3 for s in stats[a_idx:b_idx]], 50),
        "forward_p50_ms": percentile([s.forward * 1e3 for s in stats[a_idx:b_idx]], 50),
        "forward_share": sum(s.forward for s in stats[a_idx:b_idx]) / (t_b - t_a),
        "tokens_per_s": sum(s.tokens for s in stats[a_idx:b_idx]) / (t_b - t_a),
        # CPU of the whole scheduler process (driver, gRPC API, streams; the clients and the worker run elsewhere)
        # per generated token: what serving a token costs the scheduler host, whatever thread spends it.
        "sched_cpu_us_per_token": (cpu_b - cpu_a) * 1e6 / max(1, sum(s.tokens for s in stats[a_idx:b_idx])),
        "sched_cpu_share": (cpu_b - cpu_a) / (t_b - t_a),  # cores' worth of scheduler CPU over the window
    }
    if profile and probe.profiler is not None:
        buf = io.StringIO()
        pstats.Stats(probe.profiler, stream=buf).sort_stats("cumulative").print_stats(45)
        buf.write("\n---- by own time ----\n")
        pstats.Stats(probe.profiler, stream=buf).sort_stats("tottime").print_stats(30)
        out["profile"] = buf.getvalue()
        probe.profiler = None
    return out


def print_table(rows: list[dict]) -> None:
    print("\n| scheduling | running | steady steps | tokens/s | forward share | worker gap p50 (ms) | idle p50 | "
          "prepare p50 | sample p50 | forward p50 | step wall p50 | wall - worker p50 | driver CPU / iteration p50 | "
          "round trips / step | Redis cmds / step | Redis script time (ms) | Redis bytes in / step | plan bytes | "
          "result bytes | scheduler CPU / token (us) | scheduler CPU (cores) |")
    print("|" + "---|" * 21)
    for r in rows:
        print(f"| {r.get('scheduling', 'async')} | {r['running']} | {r['steady_steps']} | {r['tokens_per_s']:.0f} | "
              f"{r['forward_share']:.0%} | {r['worker_gap_p50_ms']:.2f} | {r['worker_idle_p50_ms']:.2f} | "
              f"{r['worker_prepare_p50_ms']:.2f} | {r['worker_sample_p50_ms']:.2f} | {r['forward_p50_ms']:.2f} | "
              f"{r['wall_p50_ms']:.2f} | {r['overhead_p50_ms']:.2f} | {r['engine_cpu_p50_ms']:.2f} | "
              f"{r['evalsha_per_step']:.2f} | {r['redis_cmds_per_step']:.0f} | {r['redis_evalsha_ms']:.2f} | "
              f"{r['redis_in_bytes_per_step']:.0f} | {r['plan_bytes_p50']:.0f} | {r['result_bytes_p50']:.0f} | "
              f"{r['sched_cpu_us_per_token']:.1f} | {r['sched_cpu_share']:.2f} |")
    print("\n| scheduling | running | Redis cmds / step | Redis bytes in / step | commit payload (B) | "
          "commit script p50 (ms) | commit round trip p50 (ms) |")
    print("|" + "---|" * 7)
    for r in rows:
        print(f"| {r.get('scheduling', 'async')} | {r['running']} | {r['redis_cmds_per_step']:.0f} | "
              f"{r['redis_in_bytes_per_step']:.0f} | {r['commit_payload_bytes']:.0f} | "
              f"{r['commit_script_p50_ms']:.3f} | {r['commit_p50_ms']:.2f} |")
    by = {(r.get("scheduling", "async"), r["running"]): r for r in rows}
    for n in sorted({r["running"] for r in rows}):
        a, b = by.get(("async", n)), by.get(("sync", n))
        if a and b:
            print(f"N={n}: async / sync tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.2f}x, worker gap "
                  f"{a['worker_gap_p50_ms']:.2f} vs {b['worker_gap_p50_ms']:.2f} ms, worker idle "
                  f"{a['worker_idle_p50_ms']:.2f} vs {b['worker_idle_p50_ms']:.2f} ms")


def run_mode(args, mode: str, model_dir: str, blocks: int, max_model_len: int) -> list[dict]:
    """Every N on one stack whose scheduler runs `mode` (async: pipelined; sync: --no-async-scheduling)."""
    rows: list[dict] = []
    # The scheduler detokenizes every stream with the tiny model's own word-level tokenizer.
    flags = [] if mode == "async" else ["--no-async-scheduling"]
    with Stack(model_dir, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               num_blocks=blocks, max_model_len=max_model_len, dtype="float32", device=args.device,
               extra_scheduler_args=flags, extra_worker_args=shlex.split(args.worker_args)) as stack:
        info = stack.driver.worker_info
        print(f"stack up: worker {info.model.num_layers} layers hidden {info.model.hidden_size} vocab "
              f"{info.model.vocab_size} on {info.device}, {info.num_blocks} KV blocks of {info.block_size}; "
              f"policy {stack.driver.cfg.policy}", flush=True)
        probe = Probe(stack.driver)
        probe.wrap_worker()
        # Warm every path once (tokenizer load, first plans, gRPC channels).
        run_level(stack, probe, 4, prompt_len=args.prompt_len, warmup=2, measure=5, vocab=args.vocab,
                  seed=args.seed, profile=False, tail_tokens=args.tail_tokens, direct=args.direct)
        for n in args.running:
            runs = []
            for rep in range(args.repeats):
                r = run_level(stack, probe, n, prompt_len=args.prompt_len, warmup=args.warmup,
                              measure=args.measure, vocab=args.vocab, seed=args.seed + rep,
                              profile=args.profile and rep == 0, tail_tokens=args.tail_tokens,
                              direct=args.direct)
                prof = r.pop("profile", None)
                r["scheduling"] = mode
                runs.append(r)
                print(f"N={n} run {rep + 1}: overhead p50 {r['overhead_p50_ms']:.2f} ms, p99 "
                      f"{r['overhead_p99_ms']:.2f} ms, wall p50 {r['wall_p50_ms']:.2f} ms, worker p50 "
                      f"{r['worker_p50_ms']:.2f} ms, split {json.dumps(r['split_p50_ms'])}, "
                      f"{r['evalsha_per_step']:.2f} EVALSHA/step, {r['redis_cmds_per_step']:.2f} cmds/step, "
                      f"in {r['redis_in_bytes_per_step']:.0f} B/step, out {r['redis_out_bytes_per_step']:.0f} "
                      f"B/step, commit payload {r['commit_payload_bytes']:.0f} B, driver CPU/iteration "
                      f"{r['engine_cpu_p50_ms']:.2f} ms (RPC part {r['rpc_cpu_p50_ms']:.2f}), Redis script time "
                      f"{r['redis_evalsha_ms']:.2f} ms (commit script p50 {r['commit_script_p50_ms']:.3f} ms), "
                      f"iteration p50 {r['loop_period_ms']:.2f} ms, "
                      f"plan {r['plan_bytes_p50']:.0f} B, "
                      f"result {r['result_bytes_p50']:.0f} B, {r['steps_per_s']:.1f} steps/s, "
                      f"{r['tokens_per_s']:.0f} tokens/s, scheduler CPU {r['sched_cpu_us_per_token']:.1f} us/token "
                      f"({r['sched_cpu_share']:.2f} cores)", flush=True)
                if prof:
                    print(prof, flush=True)
            runs.sort(key=lambda r: r["overhead_p50_ms"])
            median = runs[len(runs) // 2]
            median["runs_overhead_p50_ms"] = [round(r["overhead_p50_ms"], 3) for r in runs]
            rows.append(median)
        probe.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256], help="concurrent requests N")
    p.add_argument("--repeats", type=int, default=1, help="runs per N (the table shows the median run)")
    p.add_argument("--warmup", type=int, default=20, help="steady steps skipped before measuring")
    p.add_argument("--measure", type=int, default=200, help="steady steps measured")
    p.add_argument("--tail-tokens", type=int, default=300,
                   help="max_tokens = warmup + measure + this (room for the arrival spread; cancelled after)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="worker KV blocks (default: enough for max(N) requests)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None,
                   help="serve this model instead of the 2-layer random Llama (e.g. the bundled GGUF's path); "
                        "prompts still draw ids below --vocab")
    p.add_argument("--worker-args", default="", help="more worker flags, one string (e.g. '--quantization gguf')")
    p.add_argument("--direct", action="store_true",
                   help="submit straight to the driver (no gRPC streams): the loop alone, without the API layer")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this (scheduler) process, seconds (Python's default: 0.005)")
    p.add_argument("--profile", action="store_true", help="cProfile the driver thread over the measured window")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling", nargs="+", choices=["async", "sync"], default=["async", "sync"],
                   help="pipelined (--async-scheduling, the default) and/or --no-async-scheduling, side by side")
    args = p.parse_args()


    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    n_max = max(args.running)
    max_tokens = args.warmup + args.measure + args.tail_tokens
    block_size = 16
    blocks = args.num_gpu_blocks_override or n_max * -(-(args.prompt_len + max_tokens) // block_size) + 64
    max_model_len = args.prompt_len + max_tokens + 64
    tmp = tempfile.mkdtemp(prefix="llmserve-tiny-")
    rows: list[dict] = []
    try:
        model_dir = args.model or make_tiny_llama(os.path.join(tmp, "tiny-llama"), vocab_size=args.vocab,
                                                  hidden_size=args.hidden,
                                                  max_position_embeddings=max(4096, max_model_len))
        for mode in args.scheduling:
            rows += run_mode(args, mode, model_dir, blocks, max_model_len)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    if args.repeats > 1:
        for r in rows:
            print(f"N={r['running']}: overhead p50 of each run (ms): {r['runs_overhead_p50_ms']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3])
    else:
        with contextlib.suppress(KeyboardInterrupt):
            main()
