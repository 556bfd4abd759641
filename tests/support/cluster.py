"""Real llmserve processes (worker, scheduler, serve) for end-to-end tests: `llmserve/processes.py`, with test defaults.

Every process writes stdout+stderr to its own log file (``Proc.log_path``; under $LLMSERVE_TEST_LOG_DIR, default
``$TMPDIR/llmserve-test-logs``); ``Proc.log_tail()`` returns the end of it. While a process is running it is
registered, and a test that fails gets the log tail of every such process appended to its report (tests/conftest.py
registers this file as a plugin, and tests/support/redis_fixture.py's session fixture `redis_server`):

    from tests.support import cluster

    w = cluster.start_worker(["--num-gpu-blocks-override", "64"])            # waits for the worker's READY line
    s = cluster.start_scheduler(redis_url, w.port, ["--max-num-batched-tokens", "64"])
    cluster.wait_healthy(s.address)              # SERVING: the scheduler leads its pool and sees the worker
    ...                                          # grpc to s.address; s.namespace isolates its Redis keys
    cluster.kill(s)                              # SIGKILL (crash tests); or cluster.stop(s): SIGTERM, then SIGKILL

API (all blocking, all with timeouts that raise ``ProcError`` naming the process and showing its log):
- ``start_worker(extra_args=(), wait=True, env=None) -> Proc``: ``python -m llmserve.cli worker --port 0 ...``
  (``env``: variables added to this process's environment, e.g. OTEL_*);
  ``Proc.port`` / ``Proc.epoch`` come from its ``worker_svc.server.READY_LINE``.
- ``start_scheduler(redis_url, worker, extra_args=(), namespace=None, wait=True, env=None) -> Proc``: ``worker``
  is a worker ``Proc``, a port, or a "host:port" string; the namespace defaults to a fresh ``new_namespace()``
  (``Proc.namespace``). ``Proc.port`` comes from ``scheduler_svc.servers.process.LISTENING_LINE``. Listening is not
  ready: call ``wait_healthy`` before sending work.
- ``start_serve(extra_args=(), wait=True, env=None) -> Proc``: ``llmserve serve`` on a free port (and a free
  ``--http-port``: ``Proc.extra["http_port"]``), returned once it printed its ready line.
- ``start_api(scheduler_address, extra_args=(), port=0) -> Proc``: ``llmserve api`` (OpenAI HTTP) in front of a
  scheduler; ``Proc.port`` is its HTTP port.
- ``wait_ready(proc)``: for ``wait=False`` starts (e.g. two workers loading in parallel).
- ``wait_healthy(address, timeout=60)``, ``health(address) -> "SERVING" | "NOT_SERVING" | "UNKNOWN" | error code``.
- ``stop(proc)``, ``kill(proc)``, ``stop_all()`` (every process still registered; for module teardown).
- ``free_port()``, ``new_namespace(prefix)``, ``ledger(redis_url, namespace) -> RedisLedger``.

Extra args come last, so they may override the defaults (e.g. ``["--port", 50123]`` to restart a process on the
address its clients know). A worker serves one scheduler at a time: stop (or kill) the previous one before
starting the next; the new one resets the worker's batch with its first plan.

(PYTEST_DONT_REWRITE: no asserts here, and test modules import this before `pytest_plugins` registers it.)
"""

from __future__ import annotations

import os
import tempfile

import pytest

from llmserve import processes, smg_gateway
from llmserve.processes import (  # noqa: F401  (re-exported for the tests)
    START_TIMEOUT_S,
    Proc,
    ProcError,
    free_port,
    health,
    kill,
    live,
    new_namespace,
    stop,
    stop_all,
    wait_healthy,
    wait_ready,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log_dir() -> str:
    d = os.environ.get("LLMSERVE_TEST_LOG_DIR") or os.path.join(tempfile.gettempdir(), "llmserve-test-logs")
    os.makedirs(d, exist_ok=True)
    return d


# The tests compare outputs with float32 Hugging Face: workers run in float32 unless a test passes its own --dtype
# (extra args come later and win), not in `--dtype auto`'s bfloat16 on a CPU with native bf16.
FLOAT32 = ("--dtype", "float32")


def start_worker(extra_args=(), wait: bool = True, timeout: float = START_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> Proc:
    """`llmserve worker --port 0 --dtype float32 *extra_args` (bundled model unless --model is given); `env` adds
    variables."""
    return processes.start_worker([*FLOAT32, *extra_args], wait=wait, timeout=timeout, env=env, log_dir=log_dir(),
                              cwd=ROOT)


def start_scheduler(redis_url: str, worker, extra_args=(), namespace: str | None = None, wait: bool = True,
                    timeout: float = START_TIMEOUT_S, env: dict[str, str] | None = None) -> Proc:
    """`llmserve scheduler --host 127.0.0.1 --port 0 --redis-url ... --worker-address ... --namespace ...`."""
    return processes.start_scheduler(redis_url, worker, extra_args, namespace=namespace, wait=wait, timeout=timeout,
                                 env=env, log_dir=log_dir(), cwd=ROOT)


def start_serve(extra_args=(), wait: bool = True, timeout: float = 300.0, env: dict[str, str] | None = None) -> Proc:
    """`llmserve serve --port FREE --http-port FREE --dtype float32 *extra_args`; returns once it is ready (with
    `wait`)."""
    return processes.start_serve([*FLOAT32, *extra_args], wait=wait, timeout=timeout, env=env, log_dir=log_dir(),
                                 cwd=ROOT)


def start_api(scheduler: str, extra_args=(), port: int = 0, wait: bool = True, timeout: float = START_TIMEOUT_S,
              env: dict[str, str] | None = None) -> Proc:
    """`llmserve api --host 127.0.0.1 --port PORT --scheduler SCHEDULER *extra_args`; returns once it listens."""
    return processes.start_api(scheduler, extra_args, port=port, wait=wait, timeout=timeout, env=env, log_dir=log_dir(),
                           cwd=ROOT)


def start_smg(worker_urls, policy: str = "cache_aware", extra_args=(), wait: bool = True, timeout: float = 120.0,
              port: int | None = None) -> Proc:
    """The smg gateway in front of llmserve schedulers (`grpc://host:port` or "host:port"); `Proc.port` is its HTTP
    port; with `wait`, returns once every worker is healthy there."""
    return smg_gateway.start_smg(worker_urls, policy, extra_args, port=port, wait=wait, timeout=timeout,
                               log_dir=log_dir(), cwd=ROOT)


def ledger(redis_url: str, namespace: str):
    """A RedisLedger on `namespace` (e.g. for `check_ledger()` or the `active` set)."""
    import redis

    from scheduler_svc.ledger.store import RedisLedger

    return RedisLedger(redis.Redis.from_url(redis_url), namespace=namespace)


# ---- pytest plugin part (tests/conftest.py lists this module in `pytest_plugins`) ---------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for proc in live():
            report.sections.append((f"log of {proc.describe()}", proc.log_tail()))
