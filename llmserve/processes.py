"""Starting and stopping llmserve's processes: `llmserve serve`, `llmserve bench`, the experiments/ scripts and the
tests start their processes through here.

- `free_port()`; `start_redis(data_dir, ...)`: a private redis-server (fixed or free port, append-only file, extra
  flags such as --requirepass or TLS ports).
- `start_worker(...)`, `start_scheduler(...)`, `start_api(...)`, `start_serve(...)`: `python -m llmserve.cli
  worker|scheduler|api|serve` in their own session (process group), stdout+stderr appended to a log file; with
  `wait` they return once the ready line the server prints is in the log (`worker_svc.server.READY_LINE`,
  `scheduler_svc.servers.process.LISTENING_LINE`, `api_svc.server.LISTENING_LINE`, `SERVE_READY_LINE` below). Every one
  returns a `Proc`; `wait_ready`, `stop`, `kill`, `stop_all` act on them.
- The smg gateway in front of schedulers: llmserve/smg_gateway.py (`start_smg`), on the same `Proc`s.
- `health(address)`, `wait_healthy(address)`: grpc.health.v1.

Children die with the thread that started them (`spawn`'s `die_with_parent`): a `serve` (or a test run) killed with
SIGKILL leaves no worker or redis-server behind. Services never import this module (common <- services <-
llmserve).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

START_TIMEOUT_S = 120.0
LOG_TAIL_CHARS = 6000
REDIS_INSTALL_HINT = ("redis-server was not found: install it (Debian/Ubuntu: `apt-get install redis-server`, "
                      "macOS: `brew install redis`), point LLMSERVE_REDIS_SERVER at the binary, or pass --redis-url "
                      "to an existing Redis")
REDIS_READY = "Ready to accept connections"  # redis-server logs it once it listens and has loaded its data
# Printed by `llmserve serve` once the scheduler leads its pool and sees the worker.
SERVE_READY_LINE = "llmserve ready on {host}:{port}: {details}"
_SERVE_READY_RE = re.compile(r"^llmserve ready on (\S+):(\d+): ", re.M)


def parse_serve_ready_line(text: str) -> tuple[str, int] | None:
    """(host, port) from the first SERVE_READY_LINE in `text` (one line or a whole log), or None."""
    m = _SERVE_READY_RE.search(text)
    return (m.group(1), int(m.group(2))) if m else None


def free_port() -> int:
    """A currently free loopback TCP port (for flags that cannot take 0, or a port to restart a process on), drawn
    below the kernel's ephemeral range: a port the kernel hands out itself (bind to 0) is also what the next outgoing
    connection of any process may take before the process it was chosen for binds it."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# ---- processes --------------------------------------------------------------------------------------------------


class ProcError(RuntimeError):
    """A process did not start, did not become ready, or exited early; the message has the end of its log."""


@dataclass(eq=False)
class Proc:
    """One started process. `port` is its (gRPC or Redis) port, 0 until it is ready."""

    name: str  # e.g. "worker-1", "scheduler-2"
    kind: str  # "worker", "scheduler", "serve" or "redis": which ready line `wait_ready` waits for
    popen: subprocess.Popen
    log_path: str
    argv: list[str]
    port: int = 0
    epoch: str | None = None  # workers: the epoch of their ready line
    namespace: str | None = None  # schedulers: their --namespace
    extra: dict = field(default_factory=dict)  # for callers' own bookkeeping
    log_start: int = 0  # offset of this run's output in `log_path` (a restarted process appends to the same file)

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


@dataclass(eq=False)
class RedisServer(Proc):
    data_dir: str = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


_counter = itertools.count(1)
_live: list[Proc] = []
_live_lock = threading.Lock()


def _default_log_dir() -> str:
    return os.environ.get("LLMSERVE_LOG_DIR") or os.path.join(tempfile.gettempdir(), "llmserve-logs")


def _die_with_parent() -> tuple[list[str], Callable[[], None] | None]:
    """How to have the kernel SIGKILL the child when the thread that started it ends (Linux PR_SET_PDEATHSIG), so a
    parent killed with SIGKILL (or a test run killed on timeout) leaves no orphans behind: an argv prefix
    (`setpriv --pdeathsig KILL --`, which execs the command with the signal set) or, without setpriv, a
    `preexec_fn`. The prefix is preferred: a preexec_fn runs Python in the forked child, including the
    interpreter's at-fork handlers, which can crash there while another thread of a busy parent holds their state.
    ([], None) where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return [], None
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--"], None
    import ctypes

    prctl, parent, sigkill = ctypes.CDLL(None, use_errno=True).prctl, os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        prctl(1, sigkill)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: no signal will come
            os._exit(1)

    return [], preexec


def spawn(kind: str, argv: list[str], *, log_path: str | None = None, log_dir: str | None = None,
          env: dict[str, str] | None = None, cwd: str | None = None, cls: type[Proc] = Proc,
          die_with_parent: bool | None = None, **fields) -> Proc:
    """Start `argv` in its own session with stdout+stderr appended to `log_path` (default: a new file in `log_dir`)
    and register it in `live()` until `stop` or `kill`. With `die_with_parent` the child is killed when the calling
    thread ends; the default is on for the main thread (whose end is the process's) and off for other threads,
    which may end before their children (`serve`'s supervisor threads outlive theirs and pass True)."""
    if die_with_parent is None:
        die_with_parent = threading.current_thread() is threading.main_thread()
    name = f"{kind}-{next(_counter)}"
    if log_path is None:
        log_dir = log_dir or _default_log_dir()
        os.makedirs(log_dir, exist_ok=True)
        fd, log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir)
        os.close(fd)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    prefix, preexec = _die_with_parent() if die_with_parent else ([], None)
    with open(log_path, "ab") as log_file:
        start = log_file.tell()
        popen = subprocess.Popen([*prefix, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                 stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
    proc = cls(name=name, kind=kind, popen=popen, log_path=log_path, argv=argv, log_start=start, **fields)
    with _live_lock:
        _live.append(proc)
    return proc


def _ready(proc: Proc, text: str) -> bool:
    """Fill in port/epoch from the ready line in `text` (complete lines of this run's log); True once it is there."""
    from api_svc.server import parse_listening_line as parse_api_line
    from scheduler_svc.servers.process import parse_listening_line
    from worker_svc.server import parse_ready_line

    if proc.kind == "worker":
        found = parse_ready_line(text)
        if found:
            proc.port, proc.epoch = found
        return found is not None
    if proc.kind == "scheduler":
        port = parse_listening_line(text)
        if port is not None:
            proc.port = port
        return port is not None
    if proc.kind == "api":
        port = parse_api_line(text)
        if port is not None:
            proc.port = port
        return port is not None
    if proc.kind == "serve":
        found = parse_serve_ready_line(text)
        if found:
            proc.port = found[1]
        return found is not None
    return REDIS_READY in text  # redis: the port was chosen before it started


def wait_ready(proc: Proc, timeout: float | None = START_TIMEOUT_S, abort: threading.Event | None = None) -> Proc:
    """Wait for the process's ready line; fills in `port` (and a worker's `epoch`). Raises ProcError, after
    stopping it, if it exits first or is not ready within `timeout` (None: no limit) or `abort` is set."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        text = proc.log_text()[proc.log_start:]
        if _ready(proc, text[: text.rfind("\n") + 1]):
            return proc
        if not proc.alive():
            forget(proc)
            raise ProcError(f"{proc.describe()} exited before it was ready:\n{proc.log_tail()}")
        if abort is not None and abort.is_set():
            stop(proc)
            raise ProcError(f"{proc.describe()} stopped before it was ready")
        if deadline is not None and time.monotonic() > deadline:
            stop(proc)
            raise ProcError(f"{proc.describe()} not ready within {timeout:.0f}s:\n{proc.log_tail()}")
        time.sleep(0.05)


def cli_argv(*args) -> list[str]:
    """`python -m llmserve.cli *args` with this interpreter."""
    return [sys.executable, "-m", "llmserve.cli", *map(str, args)]


def start_worker(extra_args: Iterable = (), *, port: int = 0, wait: bool = True,
                 timeout: float | None = START_TIMEOUT_S, env: dict[str, str] | None = None,
                 log_dir: str | None = None, log_path: str | None = None, cwd: str | None = None) -> Proc:
    """`llmserve worker --host 127.0.0.1 --port PORT *extra_args` (0: a free port; the bundled model unless --model).
    `env` adds variables; extra args come last, so they may override the defaults."""
    argv = cli_argv("worker", "--host", "127.0.0.1", "--port", port, *extra_args)
    proc = spawn("worker", argv, log_path=log_path, log_dir=log_dir, env=env, cwd=cwd)
    return wait_ready(proc, timeout) if wait else proc


def new_namespace(prefix: str = "t") -> str:
    """A Redis key namespace nobody else uses."""
    import uuid

    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def address_of(worker) -> str:
    """A worker Proc, its port (int) or "host:port", as "host:port"."""
    if isinstance(worker, Proc):
        return worker.address
    if isinstance(worker, int):
        return f"127.0.0.1:{worker}"
    return str(worker)


def start_scheduler(redis_url: str, worker, extra_args: Iterable = (), *, namespace: str | None = None,
                    port: int = 0, wait: bool = True, timeout: float | None = START_TIMEOUT_S,
                    env: dict[str, str] | None = None, log_dir: str | None = None, log_path: str | None = None,
                    cwd: str | None = None) -> Proc:
    """`llmserve scheduler --host 127.0.0.1 --port PORT --redis-url ... --worker-address ... --namespace ...`.

    `worker`: a worker Proc, its port (int) or "host:port"; the namespace defaults to a fresh `new_namespace()`.
    Returns once it listens, which is not SERVING yet: `wait_healthy` for that."""
    namespace = namespace or new_namespace("sched")
    argv = cli_argv("scheduler", "--host", "127.0.0.1", "--port", port, "--redis-url", redis_url, "--worker-address",
                address_of(worker), "--namespace", namespace, *extra_args)
    proc = spawn("scheduler", argv, log_path=log_path, log_dir=log_dir, env=env, cwd=cwd, namespace=namespace)
    return wait_ready(proc, timeout) if wait else proc


def start_serve(extra_args: Iterable = (), *, port: int | None = None, http_port: int | None = None,
                wait: bool = True, timeout: float | None = 300.0, env: dict[str, str] | None = None,
                log_dir: str | None = None, log_path: str | None = None, cwd: str | None = None) -> Proc:
    """`llmserve serve --port PORT --http-port HTTP_PORT *extra_args` (free ports by default; `--http-port 0` in
    `extra_args` turns the HTTP API off); with `wait`, returns once it printed SERVE_READY_LINE (its scheduler
    leads the pool and sees the worker, and the HTTP API listens). `proc.extra["http_port"]` is the HTTP port.
    Ports drawn here are drawn again (up to 3 tries) if another process binds one first."""
    drawn = port is None and http_port is None
    for attempt in range(3 if drawn and wait else 1):
        chosen_http = http_port or free_port()
        argv = cli_argv("serve", "--port", port or free_port(), "--http-port", chosen_http, *extra_args)
        proc = spawn("serve", argv, log_path=log_path, log_dir=log_dir, env=env, cwd=cwd,
                     extra={"http_port": chosen_http})
        if not wait:
            return proc
        try:
            return wait_ready(proc, timeout)
        except ProcError as e:
            if not drawn or attempt == 2 or "cannot listen on" not in str(e):
                raise
    raise AssertionError("unreachable")


def start_api(scheduler: str, extra_args: Iterable = (), *, port: int = 0, wait: bool = True,
              timeout: float | None = START_TIMEOUT_S, env: dict[str, str] | None = None,
              log_dir: str | None = None, log_path: str | None = None, cwd: str | None = None) -> Proc:
    """`llmserve api --host 127.0.0.1 --port PORT --scheduler SCHEDULER *extra_args` (0: a free port); with `wait`
    it returns once it listens (`proc.port`); /health answers 200 once the scheduler is SERVING."""
    argv = cli_argv("api", "--host", "127.0.0.1", "--port", port, "--scheduler", scheduler, *extra_args)
    proc = spawn("api", argv, log_path=log_path, log_dir=log_dir, env=env, cwd=cwd)
    return wait_ready(proc, timeout) if wait else proc


def start_redis(data_dir: str, *, port: int | None = None, appendonly: bool = False, extra_args: Iterable = (),
                wait: bool = True, timeout: float = 10.0, log_path: str | None = None,
                die_with_parent: bool | None = None) -> RedisServer:
    """redis-server on 127.0.0.1 with its files in `data_dir`: on `port` (None: a free one, retried if another
    process takes it first), RDB snapshots off, an append-only file with `appendonly`. `extra_args` come last and
    may say "{port}" for the port (e.g. `--port 0 --tls-port {port}` for TLS only, `--requirepass PW`). With `wait`
    it returns once redis-server has loaded its data and listens. LLMSERVE_REDIS_SERVER overrides the binary."""
    binary = os.environ.get("LLMSERVE_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.path.exists(binary):
        raise ProcError(REDIS_INSTALL_HINT)
    os.makedirs(data_dir, exist_ok=True)
    for attempt in range(1 if port is not None or not wait else 3):
        chosen = port or free_port()
        argv = [binary, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--dir", data_dir,
                "--appendonly", "yes" if appendonly else "no", *map(str, extra_args)]
        argv = [a.replace("{port}", str(chosen)) for a in argv]
        proc = spawn("redis", argv, log_path=log_path or os.path.join(data_dir, "redis.log"), cls=RedisServer,
                     port=chosen, data_dir=data_dir, die_with_parent=die_with_parent)
        if not wait:
            return proc
        try:
            return wait_ready(proc, timeout)
        except ProcError:
            if port is not None or attempt == 2 or "Address already in use" not in proc.log_text()[proc.log_start:]:
                raise
    raise AssertionError("unreachable")


def health(address: str, service: str = "", timeout: float = 5.0, metadata=None) -> str:
    """The grpc.health.v1 status name ("SERVING", "NOT_SERVING", ...), or the gRPC error code name of the check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def forget(proc: Proc) -> None:
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
    forget(proc)
    return proc.popen.returncode


def kill(proc: Proc) -> int | None:
    """SIGKILL at once (a crash), and reap it."""
    if proc.alive():
        proc.popen.kill()
        proc.popen.wait(timeout=10)
    forget(proc)
    return proc.popen.returncode


def live() -> list[Proc]:
    """Every process started here and not yet stopped or killed (or found dead by `wait_ready`)."""
    with _live_lock:
        return list(_live)


def stop_all(everything: bool = False) -> None:
    """Stop every process in `live()`, schedulers and serve first, redis-servers last; a process whose
    `extra["keep"]` is set (a test session's shared redis-server) only with `everything`."""
    order = {"serve": 0, "api": 0, "scheduler": 1, "worker": 2, "redis": 3}
    for proc in sorted(live(), key=lambda p: order.get(p.kind, 2)):
        if everything or not proc.extra.get("keep"):
            stop(proc)
