"""`llmserve` console script: one subcommand per process or tool."""

from __future__ import annotations

import argparse
import sys


def _require_worker_extra(command: str) -> None:
    """The worker's packages are an extra (the scheduler and the API install without them): name the fix instead of
    an ImportError's traceback."""
    import importlib.util

    missing = [m for m in ("torch", "xgrammar", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"llmserve {command} runs a worker, which needs {', '.join(missing)}: pip install "
                         "'llmserve[worker]' (torch first, the build this machine needs; scripts/setup.sh does both)")


def _worker(args: argparse.Namespace) -> None:
    _require_worker_extra("worker")
    from worker_svc.server import serve

    serve(args)


def _scheduler(args: argparse.Namespace) -> None:
    from scheduler_svc.servers.process import serve

    serve(args)


def _serve(args: argparse.Namespace) -> None:
    _require_worker_extra("serve")
    from llmserve.serve import serve

    serve(args)


def _api(args: argparse.Namespace) -> None:
    from api_svc.server import serve

    serve(args)


def _generate(args: argparse.Namespace) -> None:
    from llmserve.client import generate

    sys.exit(generate(args))


def _diagnose(args: argparse.Namespace) -> None:
    from llmserve.diagnose import main as diagnose

    diagnose(args)


def _health(args: argparse.Namespace) -> None:
    """grpc.health.v1 check for container health checks: exit 0 when SERVING, 1 otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.tls import client_channel

    with client_channel(args, args.address) as channel:  # TLS with --tls-ca / --tls-cert
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                             timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            status = e.code().name
    print(status)
    sys.exit(0 if status == "SERVING" else 1)


def _add_serve(sub) -> None:
    from llmserve.serve import add_serve_args

    s = sub.add_parser("serve", help="redis-server + worker + scheduler in one command (bundled model by default); "
                       "restarts redis-server and the worker when they die")
    add_serve_args(s)
    s.set_defaults(func=_serve)


def _add_scheduler(sub) -> None:
    from scheduler_svc.servers.process import add_scheduler_args

    sc = sub.add_parser("scheduler", help="run the scheduler alone (public gRPC llmserve.v1)")
    add_scheduler_args(sc)
    sc.set_defaults(func=_scheduler)


def _add_worker(sub) -> None:
    from worker_svc.server import add_worker_args

    w = sub.add_parser("worker", help="run one model worker (gRPC llmserve.worker.v2)")
    add_worker_args(w)
    w.set_defaults(func=_worker)


def _add_api(sub) -> None:
    from api_svc.server import add_api_args

    a = sub.add_parser("api", help=API_HELP)
    add_api_args(a)
    a.set_defaults(func=_api)


def _add_tools(sub) -> None:
    from common.tls import add_client_tls_args
    from llmserve.client import add_generate_args
    from llmserve.diagnose import add_diagnose_args

    h = sub.add_parser("health", help="grpc.health.v1 check of a scheduler or worker: exit 0 when SERVING")
    h.add_argument("--address", default="127.0.0.1:50051")
    h.add_argument("--service", default="", help="service name (default: the whole server)")
    h.add_argument("--timeout", type=float, default=3.0)
    add_client_tls_args(h)
    h.set_defaults(func=_health)

    g = sub.add_parser("generate", help="stream a generation from a running server")
    add_generate_args(g)
    g.set_defaults(func=_generate)

    d = sub.add_parser("diagnose", help="read a server's metrics (or a benchmark JSON) and name what limits it: "
                       "KV capacity, batch admission or prefill interference")
    add_diagnose_args(d)
    d.set_defaults(func=_diagnose)

    from llmserve.bench.cli import add_bench_commands  # light: the heavy parts import when a command runs

    add_bench_commands(sub)


# The long-running processes' commands: `llmserve worker ...` builds (and imports) only its own flags, not the other
# services' (the API's FastAPI, the scheduler's Redis client): most of a second of each start on a 2-core box.
PROCESS_COMMANDS = {"serve": _add_serve, "scheduler": _add_scheduler, "worker": _add_worker, "api": _add_api}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only `command`'s subcommand when it is one of PROCESS_COMMANDS."""
    parser = argparse.ArgumentParser(prog="llmserve", description="Paged-attention LLM serving over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in PROCESS_COMMANDS:
        PROCESS_COMMANDS[command](sub)
        return parser
    for add in PROCESS_COMMANDS.values():
        add(sub)
    _add_tools(sub)
    return parser


API_HELP = "the OpenAI-compatible HTTP API (FastAPI) in front of a scheduler"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
