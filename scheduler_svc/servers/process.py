"""A scheduler process, wired from its settings: the Redis connection, the driver and its ledger, the public server;
`Scheduler` (what `llmserve scheduler`, `llmserve serve`, tests and benchmarks run), `serve` and the graceful drain."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import threading
import time

import redis

from common import tls, tracing
from common.config import ConfigError, add_arguments, from_namespace
from common.redis_url import probe_redis, redact_url
from common.tokenizer import load_tokenizer
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.driver.driver import Driver, DriverConfig
from scheduler_svc.ledger import redis_ha
from scheduler_svc.ledger.store import RedisLedger
from scheduler_svc.lora_registry import lora_service
from scheduler_svc.metrics import Metrics
from scheduler_svc.servers.public_server import PublicServer, build_server

__all__ = ["LISTENING_LINE", "Scheduler", "add_scheduler_args", "build_driver", "config_from_args", "connect_redis",
           "parse_listening_line", "redact_url", "serve", "shutdown"]

log = logging.getLogger("llmserve.scheduler")

# Machine-readable line on stdout once the gRPC server listens (not yet SERVING: that needs the worker and the lease).
LISTENING_LINE = "LLMSERVE_SCHEDULER_LISTENING port={port}"
_LISTENING_RE = re.compile(r"^LLMSERVE_SCHEDULER_LISTENING port=(\d+)$", re.M)


def parse_listening_line(text: str) -> int | None:
    """The port from the first LISTENING_LINE in `text` (one line or a whole log), or None."""
    m = _LISTENING_RE.search(text)
    return int(m.group(1)) if m else None


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, SchedulerConfig)


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The settings on the command line, validated (SystemExit naming the flag). `llmserve serve` also has the
    worker's --block-size and --max-model-len: those are checked against the budget here too."""
    try:
        cfg = from_namespace(SchedulerConfig, args)
        cfg.validate(block_size=getattr(args, "block_size", None), max_model_len=getattr(args, "max_model_len", None))
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    return cfg


def connect_redis(url: str) -> redis.Redis:
    """The scheduler's Redis client, after one PING went through (common/redis_url.py: a bad URL, password or TLS
    setting ends the process at start naming --redis-url)."""
    probe_redis(url)
    # Blocking pool: a burst of Generate calls that look up request ids waits for a connection instead of failing.
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30))


def build_driver(cfg: SchedulerConfig) -> tuple[Driver, RedisLedger]:
    """The driver (not started) and its ledger, from validated settings."""
    if cfg.redis_sentinel:
        client = redis_ha.connect_sentinel(cfg.redis_sentinel, cfg.redis_sentinel_master, cfg.redis_url)
    elif cfg.redis_url:
        client = connect_redis(cfg.redis_url)
    else:
        raise SystemExit("--redis-url or --redis-sentinel is required (or use `llmserve serve`, which starts a "
                         "private redis-server)")
    durability = redis_ha.Durability(cfg.redis_durability, cfg.redis_min_replicas,
                                      timeout_ms=min(cfg.lease_ttl_ms // 2, redis_ha.MAX_DURABILITY_WAIT_MS))
    ledger = RedisLedger(client, namespace=cfg.namespace, durability=durability)
    worker_credentials = None
    if cfg.worker_tls_ca is not None:
        worker_credentials = tls.channel_credentials(cfg.worker_tls_ca, cfg.worker_tls_cert, cfg.worker_tls_key)
    tokenizer = None  # an explicit --tokenizer must fit the model's vocabulary (checked once the worker answers)
    if cfg.tokenizer:
        tokenizer = (cfg.tokenizer, load_tokenizer(cfg.tokenizer).vocab_size)
    dcfg = DriverConfig(policy=PolicyConfig.unsized(cfg), tokenizer=tokenizer, async_scheduling=cfg.async_scheduling,
                        worker_address=cfg.worker_address,
                        max_num_queued_requests=cfg.max_num_queued_requests, queue_timeout=cfg.queue_timeout,
                        lease_ttl_ms=cfg.lease_ttl_ms, reattach_timeout=cfg.reattach_timeout,
                        debug_invariants=cfg.debug_invariants,
                        worker_token=cfg.worker_token, step_log=cfg.step_log,
                        worker_credentials=worker_credentials, worker_server_name=cfg.worker_tls_server_name)
    return Driver(dcfg, ledger, Metrics()), ledger


class Scheduler:
    """A whole scheduler in this process (driver + public gRPC server), built from its settings: what `llmserve
    scheduler` runs, what `llmserve serve` runs beside its children, and what tests and benchmarks embed.
    `driver` offers `.ready`, `.fatal`, `.worker_info`, `.metrics`."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.driver, self.ledger = build_driver(cfg)
        self.loras = lora_service(cfg, self.ledger.client, lambda: self.driver.worker.stub)
        self.server: PublicServer | None = None
        self.health = None
        self.host, self.port = cfg.host, 0
        self.loopback_port: int | None = None  # the plaintext loopback listener's port, when start() added one

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, loopback_listener: bool = False) -> Scheduler:
        """Listen and drive; `loopback_listener`: also serve plaintext on a free 127.0.0.1 port (loopback_port)."""
        cfg = self.cfg
        self.server, self.port, self.health = build_server(
            self.driver, f"{cfg.host}:{cfg.port}", cfg.api_key, cfg.tokenizer,
            tls.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca), self.loras)
        if loopback_listener:
            self.loopback_port = self.server.add_loopback_listener()
        if cfg.metrics_port is not None:
            self.driver.metrics.serve(cfg.metrics_port)
        self.server.start()
        self.driver.start()
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait until the driver leads its pool and sees the worker; RuntimeError on a fatal error or the timeout."""
        deadline = time.monotonic() + timeout
        while not self.driver.ready.wait(timeout=0.5):
            if self.driver.fatal:
                raise RuntimeError(f"scheduler: {self.driver.fatal}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not take the pool within {timeout:.0f} s")

    def stop(self, timeout: float = 0.0) -> None:
        """Drain (up to `timeout` seconds; 0 leaves requests in Redis for a next leader) and stop."""
        if self.server is None:
            self.driver.stop()
        else:
            shutdown(self.driver, self.server, timeout)
            self.server = None


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    tracing.setup("llmserve-scheduler", cfg.otlp_traces_endpoint)
    sched = Scheduler(cfg).start()
    log.info("scheduler listening on %s:%d (%s; worker %s over %s; redis %s)", cfg.host, sched.port,
             "plaintext" if cfg.tls_cert is None else "mutual TLS" if cfg.tls_client_ca else "TLS",
             cfg.worker_address, "plaintext" if cfg.worker_tls_ca is None else "TLS",
             f"via Sentinels {cfg.redis_sentinel}" if cfg.redis_sentinel else redact_url(cfg.redis_url))
    print(LISTENING_LINE.format(port=sched.port), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A timed wait: a signal that lands on another thread sets only a flag, which the main thread acts on when it
    # runs Python code again; an untimed wait could sleep through SIGTERM (seen: a scheduler ignoring it for 12 min).
    while not stop.wait(0.5):
        if sched.driver.fatal:
            break
    sched.stop(cfg.shutdown_timeout)
    tracing.shutdown()
    if sched.driver.fatal:
        raise SystemExit(f"scheduler: {sched.driver.fatal}")


def shutdown(driver: Driver, server: PublicServer, timeout: float) -> None:
    """Graceful drain: NOT_SERVING and no admission at once, in-flight requests finish (up to `timeout`), the rest
    are aborted; with timeout 0 they are left in Redis for the next leader (streams end UNAVAILABLE)."""
    log.info("draining (shutdown timeout %gs)", timeout)
    aborted = driver.drain(timeout)
    if aborted:
        log.warning("aborted %d requests still running after --shutdown-timeout %gs", aborted, timeout)
    driver.stop()
    server.stop(grace=2)
