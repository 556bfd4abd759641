"""The smg gateway as a child process: OpenAI HTTP in front of llmserve schedulers, spoken to over vLLM's gRPC
engine protocol. Started and stopped like llmserve's own processes (llmserve/processes.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterable

from llmserve.processes import Proc, ProcError, forget, free_port, spawn


def smg_binary() -> str:
    """The smg gateway's launcher next to this interpreter (the `smg` wheel of the test extra), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "smg")
    return local if os.path.exists(local) else (shutil.which("smg") or "smg")


def start_smg(worker_urls: Iterable[str], policy: str = "cache_aware", extra_args: Iterable = (), *,
              port: int | None = None, wait: bool = True, timeout: float = 120.0, env: dict[str, str] | None = None,
              log_dir: str | None = None, log_path: str | None = None, cwd: str | None = None) -> Proc:
    """The smg gateway (OpenAI HTTP on `port`) in front of llmserve schedulers, spoken to over vLLM's gRPC engine
    protocol: `smg launch --backend vllm --worker-urls grpc://HOST:PORT ... --policy POLICY *extra_args`. With
    `wait`, returns once every worker is healthy in its /readiness (it has fetched the tokenizer from them).
    Its Prometheus endpoint listens on `proc.extra["metrics_port"]`."""
    urls = [u if "://" in u else f"grpc://{u}" for u in worker_urls]
    port, metrics_port = port or free_port(), free_port()
    argv = [smg_binary(), "launch", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-urls", *urls, *map(str, extra_args)]
    proc = spawn("smg", argv, log_path=log_path, log_dir=log_dir, env=env, cwd=cwd,
                 extra={"metrics_port": metrics_port})
    proc.port = port
    if wait:
        wait_smg(proc, len(urls), timeout)
    return proc


def wait_smg(proc: Proc, healthy_workers: int, timeout: float = 120.0) -> Proc:
    """Wait until smg's /readiness counts `healthy_workers` healthy workers; ProcError if it exits or times out."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}/readiness", timeout=2) as r:
                if json.load(r).get("healthy_workers", 0) >= healthy_workers:
                    return proc
        except (OSError, ValueError):
            pass
        if not proc.alive():
            forget(proc)
            raise ProcError(f"{proc.describe()} exited before it was ready:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise ProcError(f"{proc.describe()}: fewer than {healthy_workers} healthy workers after {timeout:.0f} s:"
                            f"\n{proc.log_tail()}")
        time.sleep(0.2)
