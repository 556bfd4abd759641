"""`llmserve api`: the OpenAI-compatible HTTP server (uvicorn) in front of a scheduler."""

from __future__ import annotations

import argparse
import logging
import re
import socket

LISTENING_LINE = "LLMSERVE_API_LISTENING port={port}"
_LISTENING_RE = re.compile(r"^LLMSERVE_API_LISTENING port=(\d+)$", re.M)


def parse_listening_line(text: str) -> int | None:
    m = _LISTENING_RE.search(text)
    return int(m.group(1)) if m else None


def add_api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", default="127.0.0.1:50051", help="HOST:PORT of the scheduler's gRPC API")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    p.add_argument("--api-key", default=None, help="clients must send `Authorization: Bearer KEY`")
    p.add_argument("--scheduler-api-key", default=None,
                   help="the scheduler's --api-key (default: --api-key, as `llmserve serve` uses one key for both)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory for /tokenize, /detokenize and logprob tokens (default: the model "
                        "path the scheduler reports)")
    p.add_argument("--reattach-timeout", type=float, default=60.0,
                   help="seconds a stream keeps re-attaching while the scheduler is unavailable (fail-over)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (access logs at info)")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from api_svc.app import APIConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = APIConfig(scheduler=args.scheduler, api_key=args.api_key,
                    scheduler_api_key=args.scheduler_api_key or args.api_key,
                    served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                    reattach_timeout=args.reattach_timeout)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: {e}") from None
    sock.listen(2048)
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(cfg), loop="asyncio", log_level=args.log_level, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    logging.getLogger("llmserve.api").info("OpenAI API on http://%s:%d/v1 (scheduler %s)", args.host, port,
                                           args.scheduler)
    print(LISTENING_LINE.format(port=port), flush=True)
    server.run(sockets=[sock])
