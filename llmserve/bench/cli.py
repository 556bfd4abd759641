"""`llmserve bench serve | sweep | fleet | kv-waste`: argument parsing and the loops over modes and rates."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys

from llmserve.bench import peers, workloads

LLMSERVE_MODES = ("naive", "static", "continuous", "chunked")
HF_BACKENDS = ("hf-naive", "hf-static", "hf-continuous")


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text}")
    return rate


def _add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=workloads.WORKLOADS, default="chat")
    w.add_argument("--trace", metavar="FILE", help="JSONL of prompt_len/output_len/arrival_s (--workload trace)")
    w.add_argument("--num-requests", type=int, default=None, help="default 32 (a trace: all its lines)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    w.add_argument("--prompt-len", type=workloads.parse_range, metavar="LO:HI",
                   help="prompt tokens (rag: the question after the shared document)")
    w.add_argument("--output-len", type=workloads.parse_range, metavar="LO:HI", help="output tokens (ignore_eos)")
    w.add_argument("--long-prompt-len", type=workloads.parse_range, metavar="LO:HI",
                   help="mixed: the long prompts; rag: the shared documents")
    w.add_argument("--num-docs", type=int, default=4, help="rag: distinct shared documents")
    w.add_argument("--long-share", type=float, default=0.25, help="mixed: share of long prompts")
    w.add_argument("--cancel-share", type=float, default=0.3, help="cancel: share of clients that cancel")
    w.add_argument("--burst-size", type=int, default=8, help="burst: requests arriving together")

    c = p.add_argument_group("client")
    c.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (client side)")
    c.add_argument("--warmup", type=int, default=2, help="short untimed requests before the run")
    c.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 itl:100 (keys: ttft itl tpot e2e)")
    c.add_argument("--api-key", default=None)
    c.add_argument("--no-progress", action="store_true")

    s = p.add_argument_group("server")
    s.add_argument("--max-model-len", type=int, default=8192, help="passed to a launched server")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="passed to a launched server; the HF backends' batch cap (default 64)")
    s.add_argument("--model", default=None, help="model for a launched server and the HF backends (default: bundled)")
    s.add_argument("--server-args", default="",
                   help='more `llmserve serve` flags as one string: --server-args="--num-gpu-blocks-override 512"')
    s.add_argument("--poll-interval", type=float, default=0.1, help="seconds between KV-usage / memory polls")

    o = p.add_argument_group("output")
    o.add_argument("--result-dir", default="bench/out", help="where JSON, Markdown and PNG files go")
    o.add_argument("--save-requests", action="store_true", help="keep every request's raw timings in the JSON")


def add_bench_commands(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: load generator, sweeps, KV waste")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="one run of a workload against a launched or existing server")
    serve.add_argument("--backend", choices=("llmserve", "openai", *HF_BACKENDS), default="llmserve",
                       help="openai: the same workload over gRPC and then through the OpenAI HTTP API on the same "
                            "server, with what HTTP adds (TTFT, ITL, tokens/s, API CPU per token)")
    serve.add_argument("--mode", choices=LLMSERVE_MODES, default="chunked", help="llmserve scheduling mode")
    serve.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (inf: all at once)")
    serve.add_argument("--target", default=None, help="HOST:PORT of a running server instead of launching one")
    serve.add_argument("--metrics-url", default=None, help="its Prometheus URL (http://HOST:PORT/metrics)")
    serve.add_argument("--smg", action="store_true",
                       help="--backend openai (launched server): also run the workload through the smg gateway "
                       "(`smg launch --backend vllm`) in front of the same scheduler")
    serve.add_argument("--http-target", default=None,
                       help="--backend openai with --target: the HTTP API's base URL (default http://HOST:8000)")
    _add_common(serve)
    serve.set_defaults(func=_serve)

    sweep = sub.add_parser("sweep", help="offered rate from below capacity to overload, per mode")
    sweep.add_argument("--modes", default="chunked,continuous",
                       help=f"comma-separated, from {', '.join(LLMSERVE_MODES + HF_BACKENDS)}")
    sweep.add_argument("--request-rates", default="0.5,1,2,4,inf", help="comma-separated requests/s")
    _add_common(sweep)
    sweep.set_defaults(func=_sweep)

    fleet = sub.add_parser("fleet", help="the smg gateway in front of several fresh pools, once per routing policy: "
                           "prefix hit rate, TTFT, requests per pool")
    fleet.add_argument("--policies", default="cache_aware,round_robin",
                       help="comma-separated smg --policy values, each run on its own fresh pools")
    fleet.add_argument("--pools", type=int, default=2, help="llmserve pools (a launched `llmserve serve` each)")
    fleet.add_argument("--request-rate", type=_rate, default=0.5,
                       help="requests/s (default: below what two CPU pools serve of the default workload; inf: all "
                       "at once, where requests admitted in the same step share no prefix hit)")
    fleet.add_argument("--smg-args", default="",
                       help='more `smg launch` flags as one string: --smg-args="--worker-wedge-secs 60"')
    _add_common(fleet)
    # A RAG workload sized for routing: 4 shared ~512-token documents, short questions, few output tokens.
    fleet.set_defaults(func=_fleet, workload="rag", num_requests=16, long_prompt_len=(512, 512), prompt_len=(16, 32),
                       output_len=(8, 8), max_model_len=2048)

    # Its flags belong to kv_waste.py, parsed only when it runs (so `llmserve` starts without importing it):
    # '+' as the prefix makes every '--flag' a plain word that REMAINDER collects.
    kv = sub.add_parser("kv-waste", prefix_chars="+", add_help=False,
                        help="KV memory waste: paged blocks vs contiguous reservation (its own --help)")
    kv.add_argument("rest", nargs=argparse.REMAINDER)
    kv.set_defaults(func=_kv_waste)

    peers.add_command(sub)  # llmserve vs vLLM-CPU vs llama.cpp (llmserve/bench/peers.py)


def _kv_waste(args: argparse.Namespace) -> None:
    from llmserve.bench import kv_waste

    p = argparse.ArgumentParser(prog="llmserve bench kv-waste")
    kv_waste.add_args(p)
    kv_waste.main(p.parse_args(args.rest))


def _settings(args: argparse.Namespace, rate: float):
    from llmserve.bench.metrics import parse_goodput
    from llmserve.bench.runner import RunSettings

    if args.workload == "trace" and not args.trace:
        raise SystemExit("--workload trace needs --trace FILE")
    default_n = 0 if args.workload == "trace" else 32
    params = workloads.WorkloadParams(
        num_requests=args.num_requests if args.num_requests is not None else default_n, request_rate=rate,
        burstiness=args.burstiness, seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len,
        long_prompt_len=args.long_prompt_len, num_docs=args.num_docs, long_share=args.long_share,
        cancel_share=args.cancel_share,
        burst_size=args.burst_size, trace_path=args.trace)
    try:
        slo = parse_goodput(args.goodput)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return RunSettings(workload=args.workload, params=params, max_concurrency=args.max_concurrency,
                       warmup=args.warmup, slo_ms=slo, save_requests=args.save_requests,
                       progress=not args.no_progress, api_key=args.api_key, max_num_seqs=args.max_num_seqs or 64,
                       model_path=args.model, poll_interval_s=args.poll_interval)


def _server_extra(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.model:
        extra += ["--model", args.model]
    if args.max_num_seqs:
        extra += ["--max-num-seqs", str(args.max_num_seqs)]
    return extra + shlex.split(args.server_args)


def _launch(args: argparse.Namespace, mode: str):
    from llmserve.bench.runner import LocalServer

    os.makedirs(args.result_dir, exist_ok=True)
    log = os.path.join(args.result_dir, f"server_{mode}.log")
    print(f"[bench] starting llmserve ({mode}), log {log}", file=sys.stderr, flush=True)
    return LocalServer(mode, args.max_model_len, _server_extra(args), log)


def _target_for(server, mode: str):
    from llmserve.bench.runner import Target

    return Target(backend="llmserve", mode=mode, address=server.address, metrics_url=server.metrics_url,
                  pid=server.proc.pid, server_argv=server.argv, server_flags=server.flags)


def _run_and_write(target, settings, args: argparse.Namespace) -> dict:
    from llmserve.bench import report, runner

    record = runner.run(target, settings)
    path = report.write_json(record, args.result_dir)
    print(f"[bench] {report.run_label(record)} rate {record['request_rate']}: {record['completed']} completed, "
          f"{record['failed']} failed, {record['output_throughput'] or 0:.1f} output tok/s -> {path}",
          file=sys.stderr, flush=True)
    return record


def _serve(args: argparse.Namespace) -> None:
    from llmserve.bench import report
    from llmserve.bench.runner import Target

    settings = _settings(args, args.request_rate)
    if args.backend == "openai":
        _serve_http_vs_grpc(args, settings)
        return
    if args.backend != "llmserve":
        record = _run_and_write(Target(backend=args.backend, mode=args.backend, pid=os.getpid()), settings, args)
    elif args.target:
        target = Target(backend="llmserve", mode=args.mode, address=args.target, metrics_url=args.metrics_url)
        record = _run_and_write(target, settings, args)
    else:
        with _launch(args, args.mode) as server:
            record = _run_and_write(_target_for(server, args.mode), settings, args)
    print(report.markdown_table([record]))


def _serve_http_vs_grpc(args: argparse.Namespace, settings) -> None:
    """The workload over gRPC, then through the HTTP API in front of the same scheduler; both records and the
    comparison."""
    import dataclasses

    from llmserve.bench import report
    from llmserve.bench.runner import Target

    if args.target:
        grpc_target = Target(backend="llmserve", mode=args.mode, address=args.target, metrics_url=args.metrics_url)
        http_url = args.http_target or f"http://{args.target.rpartition(':')[0]}:8000"
        records = [_run_and_write(grpc_target, settings, args),
                   _run_and_write(dataclasses.replace(grpc_target, backend="openai", http_url=http_url), settings,
                                  args)]
    else:
        with _launch(args, args.mode) as server:
            grpc_target = _target_for(server, args.mode)
            records = [_run_and_write(grpc_target, settings, args)]
            http_target = dataclasses.replace(grpc_target, backend="openai", http_url=server.http_url,
                                              api_pid=server.api_pid(), model=dict(grpc_target.model))
            records.append(_run_and_write(http_target, settings, args))
            if args.smg:  # the same workload through the smg gateway in front of the same scheduler
                from llmserve import processes, smg_gateway

                gw = smg_gateway.start_smg([server.address], "round_robin",
                                     log_path=os.path.join(args.result_dir, "smg.log"))
                try:
                    records.append(_run_and_write(dataclasses.replace(
                        http_target, backend="openai", mode="smg", http_url=f"http://127.0.0.1:{gw.port}",
                        api_pid=gw.pid, text_prompts=True), settings, args))
                finally:
                    processes.stop(gw)
    print(report.markdown_table(records))
    for http_run in records[1:]:
        print(report.http_vs_grpc(records[0], http_run))


def _fleet(args: argparse.Namespace) -> None:
    from llmserve.bench import fleet

    policies = fleet.parse_policies(args.policies)
    if args.pools < 1:
        raise SystemExit(f"--pools must be >= 1, got {args.pools}")
    os.makedirs(args.result_dir, exist_ok=True)
    settings = _settings(args, args.request_rate)
    server_extra = ["--http-port", "0", *_server_extra(args)]  # smg is the HTTP front; the pools serve gRPC only
    records = [fleet.run_policy(policy, settings, args, server_extra) for policy in policies]
    print(fleet.markdown_table(records))


def _sweep(args: argparse.Namespace) -> None:
    from llmserve.bench import report
    from llmserve.bench.runner import Target

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in LLMSERVE_MODES + HF_BACKENDS]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(LLMSERVE_MODES + HF_BACKENDS)}")
    rates = [_rate(r) for r in args.request_rates.split(",") if r.strip()]
    records = []
    for mode in modes:
        if mode in HF_BACKENDS:
            for rate in rates:
                target = Target(backend=mode, mode=mode, pid=os.getpid())
                records.append(_run_and_write(target, _settings(args, rate), args))
            continue
        with _launch(args, mode) as server:  # one server per mode, reused across its rates
            for rate in rates:
                records.append(_run_and_write(_target_for(server, mode), _settings(args, rate), args))
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    table = report.markdown_table(records)
    table_path = os.path.join(args.result_dir, f"sweep_{args.workload}_{stamp}.md")
    with open(table_path, "w") as f:
        f.write(f"`{' '.join(sys.argv)}`\n\n{table}")
    plots = report.plot_sweep(records, args.result_dir, prefix=f"sweep_{args.workload}_{stamp}")
    print(table)
    print(f"[bench] table {table_path}; plots {', '.join(plots)}", file=sys.stderr)
