"""`llmserve serve`: a private redis-server, a worker process and the scheduler, as one command."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import redis

log = logging.getLogger("llmserve.serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """A private redis-server on a free loopback port, its files in `workdir`."""
    binary = os.environ.get("LLMSERVE_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise SystemExit("redis-server was not found on PATH: install it (Debian/Ubuntu: "
                         "`sudo apt-get install -y redis-server`) or pass --redis-url to an existing Redis")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


WORKER_FLAGS = ("model", "dtype", "device", "block_size", "kv_cache_memory", "gpu_memory_utilization",
                "num_gpu_blocks_override", "max_model_len", "worker_token")


def worker_argv(args: argparse.Namespace, port: int) -> list[str]:
    argv = [sys.executable, "-m", "llmserve.cli", "worker", "--port", str(port)]
    for name in WORKER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "otlp_traces_endpoint", None):  # the OTEL_* variables reach the worker through its environment
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return argv


def start_worker(args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """Start a worker process and wait for its readiness line."""
    port = free_port()
    proc = subprocess.Popen(worker_argv(args, port), stdout=subprocess.PIPE, stderr=None, text=True)
    for line in proc.stdout:
        if line.startswith("LLMSERVE_WORKER_READY"):
            # Keep draining its stdout so the pipe never fills.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, port
    raise SystemExit(f"the worker exited with code {proc.wait()} before it was ready")


def serve(args: argparse.Namespace) -> None:
    from common import tls, tracing
    from scheduler_svc.server import build_server, check_flags, redact_url, scheduler_from_args, shutdown

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The worker of `serve` is a private process on loopback and stays plaintext; --tls-* secure the public server.
    for flag in ("worker_tls_ca", "worker_tls_cert", "worker_tls_key", "worker_tls_server_name"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"--{flag.replace('_', '-')} is for a scheduler talking to a separate worker "
                             "(`llmserve scheduler`); `llmserve serve` runs its own worker on loopback without TLS")
    check_flags(args)
    tracing.setup("llmserve-scheduler", args.otlp_traces_endpoint)
    procs: list[subprocess.Popen] = []
    workdir = tempfile.mkdtemp(prefix="llmserve-")
    try:
        if not args.redis_url:
            proc, args.redis_url = start_redis(workdir)
            procs.append(proc)
        worker, wport = start_worker(args)
        procs.append(worker)
        args.worker_address = f"127.0.0.1:{wport}"
        engine, _ = scheduler_from_args(args)
        server, port, _ = build_server(engine, f"{args.host}:{args.port}", args.api_key, args.tokenizer,
                                       tls.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca))
        if args.metrics_port is not None:
            engine.metrics.serve(args.metrics_port)
        server.start()
        engine.start()
        deadline = time.monotonic() + 120
        while not engine.ready.wait(timeout=0.5):
            if engine.fatal:
                raise SystemExit(f"scheduler: {engine.fatal}")
            if time.monotonic() > deadline:
                raise SystemExit("the scheduler did not take the pool within 120 s")
        info = engine.worker_info
        print(f"llmserve ready on {args.host}:{port}: {info.model.name} on {info.device} ({info.dtype}), "
              f"{info.num_blocks} KV blocks of {info.block_size}, redis {redact_url(args.redis_url)}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            if worker.poll() is not None:
                log.error("the worker exited with code %s; stopping", worker.returncode)
                break
        shutdown(engine, server, args.shutdown_timeout)
        tracing.shutdown()
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
