"""`llmserve api`: the OpenAI-compatible HTTP server (uvicorn) in front of a scheduler."""

from __future__ import annotations

import argparse
import logging
import re
import socket

from api_svc.config import APIConfig
from common.config import ConfigError, add_arguments, from_namespace

LISTENING_LINE = "LLMSERVE_API_LISTENING port={port}"
_LISTENING_RE = re.compile(r"^LLMSERVE_API_LISTENING port=(\d+)$", re.M)


def parse_listening_line(text: str) -> int | None:
    m = _LISTENING_RE.search(text)
    return int(m.group(1)) if m else None


def add_api_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, APIConfig)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from api_svc.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = from_namespace(APIConfig, args, scheduler_api_key=args.scheduler_api_key or args.api_key)
        cfg.validate()
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {cfg.host}:{cfg.port}: {e}") from None
    sock.listen(2048)
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(cfg), loop="asyncio", log_level=cfg.log_level, timeout_keep_alive=30,
                            ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile, ssl_ca_certs=cfg.ssl_ca_certs,
                            ssl_cert_reqs=cfg.ssl_cert_reqs)
    server = uvicorn.Server(config)
    scheme = "https" if cfg.ssl_certfile else "http"
    logging.getLogger("llmserve.api").info("OpenAI API on %s://%s:%d/v1 (scheduler %s over %s)", scheme, cfg.host,
                                           port, cfg.scheduler, "TLS" if cfg.scheduler_tls_ca else "plaintext")
    print(LISTENING_LINE.format(port=port), flush=True)
    server.run(sockets=[sock])
