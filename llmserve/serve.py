"""`llmserve serve`: a private redis-server (unless --redis-url or --redis-sentinel), a worker process and the scheduler
in this process.

The supervisor restarts a redis-server or worker that dies on the same port (redis-server on the same append-only
file) and the scheduler in this process resumes; a child that exits MAX_RESTARTS + 1 times within RESTART_WINDOW_S
ends `serve` with exit code 1 and the end of its log. The worker's and the HTTP API's command lines are derived
from their settings (`WorkerConfig`, `APIConfig`): a setting `serve` was given reaches the process that has it.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from api_svc.config import (
    APIConfig,
    check_tool_flags,
    enable_auto_tool_choice,
    reasoning_parser,
    responses_store_ttl,
    ssl_ca_certs,
    ssl_cert_reqs,
    ssl_certfile,
    ssl_keyfile,
    tool_call_parser,
)
from common import config as c
from common.config import ConfigError, from_namespace, setting, to_argv
from llmserve.processes import (
    SERVE_READY_LINE,
    Proc,
    ProcError,
    cli_argv,
    forget,
    free_port,
    spawn,
    start_redis,
    stop,
    wait_ready,
)
from scheduler_svc.config import SchedulerConfig
from worker_svc.config import WorkerConfig

log = logging.getLogger("llmserve.serve")

MAX_RESTARTS = 5  # restarts of one child within RESTART_WINDOW_S before `serve` gives up
RESTART_WINDOW_S = 60.0
# Settings the worker also has that `serve` keeps for its public server: its worker is a private loopback process.
SERVE_ONLY = frozenset({"tls_cert", "tls_key", "tls_client_ca"})


@dataclass(frozen=True)
class ServeConfig:
    """`llmserve serve`'s own settings; it also takes every scheduler and worker setting."""

    host: str = setting("127.0.0.1", "address of the public gRPC API (and of the HTTP API)")
    port: int = setting(50051, "port of the public gRPC API")
    http_port: int = setting(8000, "the OpenAI-compatible HTTP API's port; 0 turns it off", check=c.at_least(0))
    served_model_name: list[str] | None = c.served_model_name()
    log_dir: str | None = setting(None, "the worker's and redis-server's logs (default: a temporary directory, "
                                  "removed at exit)")
    enable_auto_tool_choice: bool = enable_auto_tool_choice()
    tool_call_parser: str | None = tool_call_parser()
    reasoning_parser: str | None = reasoning_parser()
    responses_store_ttl: float = responses_store_ttl()
    # HTTPS of its HTTP API (vLLM's flags), passed on to the API process.
    ssl_keyfile: str | None = ssl_keyfile()
    ssl_certfile: str | None = ssl_certfile()
    ssl_ca_certs: str | None = ssl_ca_certs()
    ssl_cert_reqs: int = ssl_cert_reqs()

    def __post_init__(self):
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    c.add_arguments(p, ServeConfig, SchedulerConfig, WorkerConfig)


def worker_argv(cfg: WorkerConfig, port: int) -> list[str]:
    """The `llmserve worker` command line for `serve`'s worker: loopback host and `port`, then every setting whose
    value differs from its default (TLS settings excepted)."""
    return cli_argv("worker", "--host", "127.0.0.1", "--port", port,
                    *to_argv(cfg, exclude=SERVE_ONLY | {"host", "port"}))


def api_argv(args: argparse.Namespace, own: ServeConfig, scheduler_port: int, redis_url: str | None = None,
             metrics_port: int | None = None, loopback_port: int | None = None) -> list[str]:
    """The `llmserve api` command line of `serve`: on --host and --http-port, in front of its scheduler, with every
    API setting `serve` shares (the scheduler's --api-key: clients use one key for both; --tokenizer;
    --served-model-name; --ssl-*; the scheduler's Redis and --namespace, for stored responses). `loopback_port`:
    the scheduler's plaintext loopback listener, used instead of its public (TLS) port."""
    host = "127.0.0.1" if own.host in ("0.0.0.0", "::") else own.host
    scheduler = f"127.0.0.1:{loopback_port}" if loopback_port else f"{host}:{scheduler_port}"
    where = {"host": own.host, "port": own.http_port, "scheduler": scheduler}
    if redis_url:
        where["redis_url"] = redis_url
    if metrics_port:  # the API's /metrics re-serves the scheduler's vllm:* series, as vLLM's :8000/metrics does
        where["scheduler_metrics_url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    api = from_namespace(APIConfig, args, **where)
    return cli_argv("api", *[w for k, v in where.items() for w in (c.flag(k), v)], *to_argv(api, exclude=where))


def taken_port(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be listened on (already in use, ...), or None; port 0 is always free."""
    if not port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(own: ServeConfig) -> None:
    """Refuse at start, before any child is started, a gRPC or HTTP port that something else holds."""
    for flag, port in (("--port", own.port), ("--http-port", own.http_port)):
        why = taken_port(own.host, port)
        if why:
            raise SystemExit(f"llmserve serve: {flag} {port} cannot be used on {own.host}: {why}; stop what holds "
                             f"it or give {flag} another port")


class _Child:
    """One supervised process: started by `start` (which must not wait), restarted whenever it exits."""

    def __init__(self, name: str, start: Callable[[], Proc], ready_timeout: float | None):
        self.name, self.start, self.ready_timeout = name, start, ready_timeout
        self.proc: Proc | None = None
        self.ready = threading.Event()  # the first run is ready
        self.exits: collections.deque[float] = collections.deque()
        self.restarts = 0


class Supervisor:
    """Keeps `serve`'s children running: each has a thread that starts it, waits for its ready line, waits for it to
    exit and starts it again (the caller's `start` reuses the port and data directory). More than MAX_RESTARTS
    exits of one child within RESTART_WINDOW_S (counting runs that never got ready) sets `failure`."""

    def __init__(self):
        self.children: list[_Child] = []
        self.stopping = threading.Event()
        self.failure: str | None = None  # set once, by the thread of a child that keeps failing

    def add(self, name: str, start: Callable[[], Proc], ready_timeout: float | None = None) -> _Child:
        child = _Child(name, start, ready_timeout)
        self.children.append(child)
        threading.Thread(target=self._keep_running, args=(child,), name=f"supervise-{name}", daemon=True).start()
        return child

    def _keep_running(self, child: _Child) -> None:
        while not self.stopping.is_set():
            try:
                child.proc = child.start()
            except (OSError, ProcError) as e:
                self.failure = f"llmserve serve: cannot start the {child.name}: {e}"
                return
            try:
                wait_ready(child.proc, child.ready_timeout, abort=self.stopping)
                if child.restarts:
                    log.info("%s is back (pid %d)", child.name, child.proc.pid)
                child.ready.set()
                child.proc.popen.wait()
            except ProcError:
                pass  # exited (or was stopped) before it was ready: an exit like any other
            forget(child.proc)
            if self.stopping.is_set():
                return
            now = time.monotonic()
            child.exits.append(now)
            while child.exits[0] < now - RESTART_WINDOW_S:
                child.exits.popleft()
            code = child.proc.popen.returncode
            if len(child.exits) > MAX_RESTARTS:
                tail = "\n".join(child.proc.log_text()[child.proc.log_start:].splitlines()[-30:])
                self.failure = (f"llmserve serve: the {child.name} exited {len(child.exits)} times within "
                                f"{RESTART_WINDOW_S:.0f} s (last exit code {code}); giving up. Last lines of its log "
                                f"{child.proc.log_path}:\n{tail}")
                return
            child.restarts += 1
            log.warning("the %s exited with code %s; restarting it (restart %d of at most %d within %.0f s)",
                        child.name, code, len(child.exits), MAX_RESTARTS, RESTART_WINDOW_S)

    def stop(self) -> None:
        """Stop the children, last added first, and let no thread restart them."""
        self.stopping.set()
        for child in reversed(self.children):
            if child.proc is not None:
                stop(child.proc, timeout=15)


def serve(args: argparse.Namespace) -> None:
    """`llmserve serve`: a private redis-server (unless --redis-url), a worker process and the scheduler in this
    process, until SIGTERM / Ctrl-C; the children are supervised (module docstring)."""
    from common import tracing
    from scheduler_svc.servers.process import Scheduler, config_from_args, redact_url

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The worker of `serve` is a private process on loopback and stays plaintext; --tls-* secure the public server.
    for flag in ("worker_tls_ca", "worker_tls_cert", "worker_tls_key", "worker_tls_server_name"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"--{flag.replace('_', '-')} is for a scheduler talking to a separate worker "
                             "(`llmserve scheduler`); `llmserve serve` runs its own worker on loopback without TLS")
    sched_cfg = config_from_args(args)
    try:
        own, worker_cfg = from_namespace(ServeConfig, args), from_namespace(WorkerConfig, args)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    check_ports(own)
    if own.http_port:  # the API's HTTPS files, checked before any child starts (the API would only log them)
        try:
            from_namespace(APIConfig, args).validate()
        except ConfigError as e:
            raise SystemExit(str(e)) from None
    tracing.setup("llmserve-scheduler", sched_cfg.otlp_traces_endpoint)
    workdir = tempfile.mkdtemp(prefix="llmserve-")
    log_dir = own.log_dir or workdir
    os.makedirs(log_dir, exist_ok=True)
    sup = Supervisor()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stopping.set())
    sched: Scheduler | None = None
    api: _Child | None = None
    keep_logs = False  # a failed serve keeps the logs its message points to

    def trouble() -> str | None:
        if sup.failure:
            return sup.failure
        if sched is not None and sched.driver.fatal:
            return f"scheduler: {sched.driver.fatal}"
        return None

    try:
        children = []
        redis_url = sched_cfg.redis_url
        if not redis_url and not sched_cfg.redis_sentinel:
            redis_dir, redis_port = os.path.join(workdir, "redis"), free_port()
            redis_log = os.path.join(log_dir, "redis.log")
            children.append(sup.add("redis-server", lambda: start_redis(
                redis_dir, port=redis_port, appendonly=True, wait=False, log_path=redis_log, die_with_parent=True)))
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        worker_port = free_port()
        wargv, worker_log = worker_argv(worker_cfg, worker_port), os.path.join(log_dir, "worker.log")
        children.append(sup.add("worker", lambda: spawn("worker", wargv, log_path=worker_log, die_with_parent=True)))
        sched_cfg = replace(sched_cfg, redis_url=redis_url, worker_address=f"127.0.0.1:{worker_port}")
        for child in children:  # both start at once; the worker (loading the model) takes longer
            while not child.ready.wait(0.2) and not sup.stopping.is_set():
                if trouble():
                    raise SystemExit(trouble())
        if sup.stopping.is_set():
            return
        # With --tls-cert its own API connects to a plaintext loopback listener of the scheduler: the certificate
        # may name a public host, be signed by any CA, or (--tls-client-ca) need a client certificate `serve` lacks.
        sched = Scheduler(sched_cfg).start(loopback_listener=bool(own.http_port and sched_cfg.tls_cert))
        if own.http_port:  # the OpenAI-compatible HTTP API, a process of its own in front of this scheduler
            metrics_port = sched_cfg.metrics_port
            if metrics_port is None:  # on loopback only, for the API to read
                metrics_port = free_port()
                sched.driver.metrics.serve(metrics_port, host="127.0.0.1")
            api_cmd = api_argv(args, own, sched.port, redis_url, metrics_port, sched.loopback_port)
            api_log = os.path.join(log_dir, "api.log")
            api = sup.add("api", lambda: spawn("api", api_cmd, log_path=api_log, die_with_parent=True))
        deadline = time.monotonic() + 120
        while not sched.driver.ready.wait(0.5) and not sup.stopping.is_set():
            if trouble():
                raise SystemExit(trouble())
            if time.monotonic() > deadline:
                raise SystemExit("the scheduler did not take the pool within 120 s")
        if sup.stopping.is_set():
            return
        http = ""
        if api is not None:  # started with the scheduler; ready once it listens
            while not api.ready.wait(0.2) and not sup.stopping.is_set():
                if trouble():
                    raise SystemExit(trouble())
            scheme = "https" if own.ssl_certfile else "http"
            http = f"; OpenAI API on {scheme}://{own.host}:{own.http_port}/v1"
        if sup.stopping.is_set():
            return
        info = sched.driver.worker_info
        print(SERVE_READY_LINE.format(host=own.host, port=sched.port, details=(
            f"{info.model.name} on {info.device} ({info.dtype}), {info.num_blocks} KV blocks of {info.block_size}, "
            f"redis {redact_url(redis_url) if redis_url else 'via Sentinels ' + sched_cfg.redis_sentinel}{http}; "
            f"logs in {log_dir}")), flush=True)
        while not sup.stopping.wait(0.5):
            if trouble():
                raise SystemExit(trouble())
    except BaseException:
        keep_logs = log_dir == workdir
        raise
    finally:
        sup.stopping.set()
        if api is not None and api.proc is not None and api.proc.alive():
            api.proc.popen.terminate()  # first: it stops taking requests while its streams drain with the scheduler
        if sched is not None:
            sched.stop(sched_cfg.shutdown_timeout)
        sup.stop()
        tracing.shutdown()
        if keep_logs:
            shutil.rmtree(os.path.join(workdir, "redis"), ignore_errors=True)
            print(f"llmserve serve: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
