"""`llmserve` console script: one subcommand per process or tool."""

from __future__ import annotations

import argparse
import sys


def _worker(argv_ns: argparse.Namespace) -> None:
    from worker_svc.server import serve

    serve(argv_ns)


def build_parser() -> argparse.ArgumentParser:
    from worker_svc.server import add_worker_args

    parser = argparse.ArgumentParser(prog="llmserve", description="Paged-attention LLM serving over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run one model worker (gRPC llmserve.worker.v1)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    add_worker_args(w)
    w.set_defaults(func=_worker)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
