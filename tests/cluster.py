"""Start and stop real llmserve processes (worker, scheduler) for end-to-end tests.

Every process writes stdout+stderr to its own log file (``Proc.log_path``); ``Proc.log_tail()`` returns the
end of it. While a process is running it is registered here, and a test that fails gets the log tail of every
such process appended to its report -- if the test module activates this file as a plugin:

    pytest_plugins = ("tests.cluster",)          # in the test module (optional)
    from tests.redis_fixture import redis_server  # noqa: F401  (a session-wide redis-server URL)
    from tests import cluster

    w = cluster.start_worker(["--num-gpu-blocks-override", "64"])            # waits for LLMSERVE_WORKER_READY
    s = cluster.start_scheduler(redis_url, w.port, ["--max-num-batched-tokens", "64"])
    cluster.wait_healthy(s.address)              # SERVING: the scheduler leads its pool and sees the worker
    ...                                          # grpc to s.address; s.namespace isolates its Redis keys
    cluster.kill(s)                              # SIGKILL (crash tests); or cluster.stop(s): SIGTERM, then SIGKILL

API (all blocking, all with timeouts that raise ``ProcError`` naming the process and showing its log):
- ``start_worker(extra_args=(), wait=True, env=None) -> Proc``: ``python -m llmserve.cli worker --port 0 ...``
  (``env``: variables added to this process's environment, e.g. OTEL_*);
  ``Proc.port`` / ``Proc.epoch`` come from its ``LLMSERVE_WORKER_READY port=N epoch=E`` line.
- ``start_scheduler(redis_url, worker, extra_args=(), namespace=None, wait=True, env=None) -> Proc``: ``worker``
  is a worker ``Proc``, a port, or a "host:port" string; the namespace defaults to a fresh ``new_namespace()``
  (``Proc.namespace``). ``Proc.port`` comes from ``LLMSERVE_SCHEDULER_LISTENING port=N``. Listening is not
  ready: call ``wait_healthy`` before sending work.
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

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_READY = re.compile(r"^LLMSERVE_WORKER_READY port=(\d+) epoch=(\S+)", re.M)
SCHEDULER_LISTENING = re.compile(r"^LLMSERVE_SCHEDULER_LISTENING port=(\d+)", re.M)
START_TIMEOUT_S = 120.0
LOG_TAIL_CHARS = 6000

_counter = itertools.count(1)
_live: list[Proc] = []
_live_lock = threading.Lock()


class ProcError(RuntimeError):
    """A process did not start, did not become ready, or exited early; the message has its log tail."""


@dataclass
class Proc:
    """One started process. `port` is its gRPC port (0 until ready)."""

    name: str  # e.g. "worker-1", "scheduler-2"
    popen: subprocess.Popen
    log_path: str
    argv: list[str]
    port: int = 0
    epoch: str | None = None  # workers: the epoch from the readiness line
    namespace: str | None = None  # schedulers: their --namespace
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log_text()
        return text if len(text) <= chars else "..." + text[-chars:]

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        return f"{self.name} (pid {self.pid}, {state}, port {self.port}, log {self.log_path})"


def free_port() -> int:
    """A currently free loopback port (for flags such as --metrics-port that cannot take 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_namespace(prefix: str = "t") -> str:
    """A Redis key namespace no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def ledger(redis_url: str, namespace: str):
    """A RedisLedger on `namespace` (e.g. for `check_ledger()` or the `active` set)."""
    import redis

    from scheduler_svc.store import RedisLedger

    return RedisLedger(redis.Redis.from_url(redis_url), namespace=namespace)


def _log_dir() -> str:
    d = os.environ.get("LLMSERVE_TEST_LOG_DIR") or os.path.join(tempfile.gettempdir(), "llmserve-test-logs")
    os.makedirs(d, exist_ok=True)
    return d


def _spawn(kind: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
    name = f"{kind}-{next(_counter)}"
    fd, log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=_log_dir())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with os.fdopen(fd, "wb") as log:
        popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    proc = Proc(name=name, popen=popen, log_path=log_path, argv=argv)
    with _live_lock:
        _live.append(proc)
    return proc


def wait_ready(proc: Proc, timeout: float = START_TIMEOUT_S) -> Proc:
    """Wait for the readiness line of a worker (READY) or scheduler (LISTENING); fills in `port`/`epoch`."""
    pattern = WORKER_READY if proc.name.startswith("worker") else SCHEDULER_LISTENING
    deadline = time.monotonic() + timeout
    while True:
        m = pattern.search(proc.log_text())
        if m:
            proc.port = int(m.group(1))
            if m.re is WORKER_READY:
                proc.epoch = m.group(2)
            return proc
        if not proc.alive():
            _unregister(proc)
            raise ProcError(f"{proc.describe()} exited before it was ready:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            stop(proc)
            raise ProcError(f"{proc.describe()} not ready within {timeout:.0f}s:\n{proc.log_tail()}")
        time.sleep(0.05)


def start_worker(extra_args=(), wait: bool = True, timeout: float = START_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> Proc:
    """`llmserve worker --port 0 *extra_args` (bundled model unless --model is given); `env` adds variables."""
    proc = _spawn("worker", [sys.executable, "-m", "llmserve.cli", "worker", "--port", "0", *map(str, extra_args)],
                  env)
    return wait_ready(proc, timeout) if wait else proc


def start_scheduler(redis_url: str, worker, extra_args=(), namespace: str | None = None, wait: bool = True,
                    timeout: float = START_TIMEOUT_S, env: dict[str, str] | None = None) -> Proc:
    """`llmserve scheduler --host 127.0.0.1 --port 0 --redis-url ... --worker-address ... --namespace ...`.

    `worker`: a worker Proc, its port (int) or "host:port". Returns once it listens (not yet SERVING).
    """
    if isinstance(worker, Proc):
        address = worker.address
    elif isinstance(worker, int):
        address = f"127.0.0.1:{worker}"
    else:
        address = str(worker)
    namespace = namespace or new_namespace("sched")
    argv = [sys.executable, "-m", "llmserve.cli", "scheduler", "--host", "127.0.0.1", "--port", "0",
            "--redis-url", redis_url, "--worker-address", address, "--namespace", namespace, *map(str, extra_args)]
    proc = _spawn("scheduler", argv, env)
    proc.namespace = namespace
    return wait_ready(proc, timeout) if wait else proc


def health(address: str, service: str = "", timeout: float = 5.0, metadata=None) -> str:
    """The grpc.health.v1 status name, or the gRPC error code name when the check itself fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_healthy(address: str, timeout: float = 60.0, service: str = "", proc: Proc | None = None) -> None:
    """Poll grpc.health.v1 until SERVING; `proc` (optional) is checked for an early exit and shown on failure."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = health(address, service, timeout=2.0)
        if last == "SERVING":
            return
        if proc is not None and not proc.alive():
            raise ProcError(f"{proc.describe()} exited while waiting for SERVING:\n{proc.log_tail()}")
        time.sleep(0.1)
    shown = f"\n{proc.describe()}:\n{proc.log_tail()}" if proc is not None else ""
    raise ProcError(f"{address} not SERVING within {timeout:.0f}s (last: {last}){shown}")


def _unregister(proc: Proc) -> None:
    with _live_lock:
        if proc in _live:
            _live.remove(proc)


def stop(proc: Proc, timeout: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout`; returns the exit code. Safe to call twice."""
    if proc.alive():
        try:
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout=10)
    _unregister(proc)
    return proc.popen.returncode


def kill(proc: Proc) -> int | None:
    """SIGKILL at once (a crash), and reap it."""
    if proc.alive():
        proc.popen.kill()
        proc.popen.wait(timeout=10)
    _unregister(proc)
    return proc.popen.returncode


def live() -> list[Proc]:
    with _live_lock:
        return list(_live)


def stop_all() -> None:
    """Stop every process started here and still registered (schedulers first)."""
    for proc in sorted(live(), key=lambda p: not p.name.startswith("scheduler")):
        stop(proc)


# ---- pytest plugin part (active with `pytest_plugins = ("tests.cluster",)`) --------------------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for proc in live():
            report.sections.append((f"log of {proc.describe()}", proc.log_tail()))
