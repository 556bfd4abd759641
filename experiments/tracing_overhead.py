"""Scheduler step overhead with OpenTelemetry tracing off vs on.

Reuses experiments/scheduler_overhead.py's machinery (`Stack`, `Probe`, `run_level`: real redis-server, a worker process
serving a 2-layer random-weight Llama, the scheduler in this process, N concurrent gRPC streams from a client
process) and measures steady decode steps, overhead = step wall time - the worker's own execute time, in modes:

    off    tracing disabled in the scheduler and in its worker (the default deployment)
    otlp   the scheduler traces through `tracing.setup` (BatchSpanProcessor + OTLP/gRPC exporter) and its worker
           runs with --otlp-traces-endpoint; both export to an OTLP receiver in a separate process, so the
           export cost (serialisation, gRPC, the exporter threads) is real and nothing is exported to us
    sdk    spans built in the scheduler by a TracerProvider with no processor (no export, worker off): the cost of
           building spans alone

`off` and `sdk` share one stack, `otlp` has its own (its worker traces for its whole life); both stacks are built
alike. Runs interleave (the mode order rotates each repeat) because this 2-core box is noisy. The table shows,
per mode and N, the median over repeats of each run's p50/p99 overhead and the ratio to `off`. Spans created in
this process are counted (a wrapper on the SDK's `Tracer.start_span`) to show that `off` builds none.

    .venv/bin/python -m experiments.tracing_overhead                         # N = 16, 64; 5 repeats (~2 minutes)
    .venv/bin/python -m experiments.tracing_overhead --modes off otlp --repeats 5 --json /tmp/tracing.json

Results: experiments/TRACING.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import timeit

from experiments.scheduler_overhead import REPO, Probe, Stack, make_tiny_llama, run_level
from llmserve.bench.metrics import percentile

MODES = ("off", "otlp", "sdk")

# ------------------------------------------------------------------------------------- the OTLP receiver process


def receiver_main() -> None:
    """`--receiver`: an OTLP/gRPC trace receiver that counts what it gets. Prints `PORT n`, then answers each
    stdin line with a JSON line of its counts; exits at EOF."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tspb_grpc

    lock = threading.Lock()
    counts: dict = {"requests": 0, "bytes": 0, "spans": {}}

    class Receiver(tspb_grpc.TraceServiceServicer):
        def Export(self, request, context):
            with lock:
                counts["requests"] += 1
                counts["bytes"] += request.ByteSize()
                for rs in request.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes
                                    if a.key == "service.name"), "")
                    n = sum(len(ss.spans) for ss in rs.scope_spans)
                    counts["spans"][service] = counts["spans"].get(service, 0) + n
            return tspb.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    tspb_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    for _ in sys.stdin:
        with lock:
            print(json.dumps(counts), flush=True)
    server.stop(grace=1).wait()


class ReceiverProc:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.tracing_overhead", "--receiver"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the OTLP receiver did not start (rc={self.proc.poll()})")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"

    def counts(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ------------------------------------------------------------------------------------------- span counting


class SpanCounter:
    """Counts every SDK span started in this process (any provider), to show that `off` builds none."""

    def __init__(self):
        from opentelemetry.sdk.trace import Tracer

        self.count = 0
        self._cls, self._orig = Tracer, Tracer.start_span
        orig = self._orig

        def start_span(tracer, *a, **kw):
            self.count += 1
            return orig(tracer, *a, **kw)

        Tracer.start_span = start_span

    def close(self) -> None:
        self._cls.start_span = self._orig


# ------------------------------------------------------------------------------------------------ main


def summarize(runs: list[dict]) -> dict:
    """Median over repeats of each run's numbers (every run's p50 kept too)."""

    def med(key, sub=None):
        return percentile([r[key][sub] if sub else r[key] for r in runs], 50)

    return {"overhead_p50_ms": med("overhead_p50_ms"), "overhead_p99_ms": med("overhead_p99_ms"),
            "engine_cpu_p50_ms": med("engine_cpu_p50_ms"), "rpc_minus_worker_p50_ms": med("split_p50_ms",
                                                                                          "rpc_minus_worker"),
            "other_p50_ms": med("split_p50_ms", "other"), "wall_p50_ms": med("wall_p50_ms"),
            "worker_p50_ms": med("worker_p50_ms"), "steps_per_s": med("steps_per_s"),
            "spans_per_step": med("spans_per_step"), "steady_steps": sum(r["steady_steps"] for r in runs),
            "runs_overhead_p50_ms": [round(r["overhead_p50_ms"], 3) for r in runs],
            "runs_overhead_p99_ms": [round(r["overhead_p99_ms"], 3) for r in runs]}


def print_table(rows: list[dict]) -> None:
    print("\n| running | mode | overhead p50 (ms) | overhead p99 (ms) | p50 / off | p99 / off | driver CPU / "
          "iteration p50 (ms) | CPU / off | RPC - worker p50 (ms) | step wall p50 (ms) | worker p50 (ms) | "
          "spans created here / step | runs' p50 (ms) |")
    print("|" + "---|" * 13)
    for r in rows:
        print(f"| {r['running']} | {r['mode']} | {r['overhead_p50_ms']:.2f} | {r['overhead_p99_ms']:.2f} | "
              f"{r['p50_ratio']:.2f} | {r['p99_ratio']:.2f} | {r['engine_cpu_p50_ms']:.2f} | {r['cpu_ratio']:.2f} | "
              f"{r['rpc_minus_worker_p50_ms']:.2f} | {r['wall_p50_ms']:.2f} | {r['worker_p50_ms']:.2f} | "
              f"{r['spans_per_step']:.2f} | {r['runs_overhead_p50_ms']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[16, 64], help="concurrent requests N")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=5, help="runs per mode and N, interleaved")
    p.add_argument("--warmup", type=int, default=20, help="steady steps skipped before measuring")
    p.add_argument("--measure", type=int, default=200, help="steady steps measured per run")
    p.add_argument("--tail-tokens", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if "off" not in args.modes:
        args.modes.insert(0, "off")  # the reference every ratio is taken against

    # `off` must be off: no OTEL_* variable reaches the workers or tracing.setup.
    for var in [v for v in os.environ if v.startswith("OTEL_")]:
        del os.environ[var]
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    from common import tracing

    n_max = max(args.running)
    max_tokens = args.warmup + args.measure + args.tail_tokens
    blocks = n_max * -(-(args.prompt_len + max_tokens) // 16) + 64
    max_model_len = args.prompt_len + max_tokens + 64
    tmp = tempfile.mkdtemp(prefix="llmserve-tiny-")
    receiver = ReceiverProc() if "otlp" in args.modes else None
    counter = SpanCounter()
    stacks: dict[str, tuple[Stack, Probe]] = {}  # "plain" (worker off), "traced" (worker exporting)
    rows: list[dict] = []
    results: dict[tuple[int, str], list[dict]] = {}
    otlp_tp = received = None
    traced_steps = 0
    try:
        model_dir = make_tiny_llama(os.path.join(tmp, "tiny-llama"), vocab_size=args.vocab, hidden_size=args.hidden,
                                    max_position_embeddings=max(4096, max_model_len))

        def start(name: str, worker_otlp: str | None) -> None:
            s = Stack(model_dir, max_num_seqs=256, max_num_batched_tokens=4096, num_blocks=blocks,
                      max_model_len=max_model_len, dtype="float32", device="cpu",
                      worker_otlp_endpoint=worker_otlp)
            stacks[name] = (s, None)
            s.start()
            probe = Probe(s.driver)
            probe.wrap_worker()
            stacks[name] = (s, probe)

        start("plain", None)
        if receiver is not None:
            start("traced", receiver.endpoint)
            # The product's own set-up: what `llmserve scheduler --otlp-traces-endpoint` builds.
            assert tracing.setup("llmserve-scheduler", receiver.endpoint)
            otlp_tp = tracing.provider
            tracing.disable()
        sdk_tp = TracerProvider(resource=Resource.create({SERVICE_NAME: "llmserve-scheduler"}))

        def use(mode: str) -> tuple[Stack, Probe]:
            if mode == "off":
                tracing.disable()
            else:
                tracing.install(otlp_tp if mode == "otlp" else sdk_tp)
            return stacks["traced" if mode == "otlp" else "plain"]

        kw = dict(prompt_len=args.prompt_len, vocab=args.vocab, profile=False, tail_tokens=args.tail_tokens)
        for mode in args.modes:  # warm every path once (tokenizer, channels, exporter connection)
            s, probe = use(mode)
            run_level(s, probe, 4, warmup=2, measure=5, seed=args.seed, **kw)
        for n in args.running:
            for rep in range(args.repeats):
                order = args.modes[rep % len(args.modes):] + args.modes[: rep % len(args.modes)]
                for mode in order:
                    s, probe = use(mode)
                    assert tracing.enabled == (mode != "off")
                    spans0, steps0 = counter.count, len(s.driver.step_stats)
                    r = run_level(s, probe, n, warmup=args.warmup, measure=args.measure, seed=args.seed + rep, **kw)
                    steps = len(s.driver.step_stats) - steps0
                    r["spans_created"] = counter.count - spans0
                    r["spans_per_step"] = r["spans_created"] / steps if steps else float("nan")
                    if mode == "off" and r["spans_created"]:
                        raise RuntimeError(f"tracing off created {r['spans_created']} spans")
                    results.setdefault((n, mode), []).append(r)
                    print(f"N={n} rep {rep + 1} {mode:>4}: overhead p50 {r['overhead_p50_ms']:.2f} ms, p99 "
                          f"{r['overhead_p99_ms']:.2f} ms, driver CPU/iteration {r['engine_cpu_p50_ms']:.2f} ms, "
                          f"RPC-worker {r['split_p50_ms']['rpc_minus_worker']:.2f} ms, "
                          f"{r['spans_per_step']:.2f} spans created here/step", flush=True)
            off = summarize(results[(n, "off")])
            for mode in args.modes:
                row = {"running": n, "mode": mode, **summarize(results[(n, mode)])}
                row["p50_ratio"] = row["overhead_p50_ms"] / off["overhead_p50_ms"]
                row["p99_ratio"] = row["overhead_p99_ms"] / off["overhead_p99_ms"]
                row["cpu_ratio"] = row["engine_cpu_p50_ms"] / off["engine_cpu_p50_ms"]
                rows.append(row)
    finally:
        tracing.disable()
        if otlp_tp is not None:
            otlp_tp.shutdown()  # flush the scheduler's last spans
        for name, (s, probe) in reversed(list(stacks.items())):
            if probe is not None:
                probe.close()
            if name == "traced":
                traced_steps = len(s.driver.step_stats)
            s.stop()  # SIGTERM: the traced worker flushes its spans
        counter.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if receiver is not None:
            received = receiver.counts()
            receiver.close()
    print_table(rows)
    print(f"\nspans created in this process with tracing off: "
          f"{sum(r['spans_created'] for (n, m), rs in results.items() if m == 'off' for r in rs)}")
    # What tracing off leaves in the step: `if tracing.enabled:` checks (driver: 2 a step + 1 a new request;
    # worker: 2 a step).
    check_ns = timeit.timeit("if tracing.enabled: pass", globals={"tracing": tracing}, number=1_000_000) * 1e3
    print(f"one `if tracing.enabled` check with tracing off: {check_ns:.0f} ns")
    if received is not None:
        print(f"OTLP receiver: {received['spans']} spans in {received['requests']} export requests, "
              f"{received['bytes'] / 1e6:.1f} MB; the traced scheduler ran {traced_steps} steps "
              f"({received['spans'].get('llmserve-scheduler', 0) / max(traced_steps, 1):.2f} scheduler and "
              f"{received['spans'].get('llmserve-worker', 0) / max(traced_steps, 1):.2f} worker spans per step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "received": received, "off_check_ns": check_ns,
                       "runs": {f"{n}/{m}": rs for (n, m), rs in results.items()}}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--receiver":
        receiver_main()
    else:
        main()
