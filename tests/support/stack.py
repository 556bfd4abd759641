"""A scheduler inside the test (or benchmark) process, and `Stack`: a private redis-server, a worker process and that
scheduler, for code that looks inside the driver. The product's pieces, assembled the way `llmserve serve` does."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace

from common import config
from common.validation import ConfigError
from llmserve.processes import Proc, RedisServer, address_of, start_redis, start_worker, stop, wait_ready
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.servers.process import Scheduler


def start_scheduler_in_process(redis_url: str, worker, extra_args: Iterable = (), *, host: str = "127.0.0.1",
                               port: int = 0, ready_timeout: float | None = 180.0, **settings) -> Scheduler:
    """A Scheduler on `worker` (a Proc, port or address) with `llmserve scheduler` flags (`extra_args`) and/or
    settings by name; started, and with `ready_timeout` (None: don't wait) once it leads its pool."""
    cfg = replace(config.parse(SchedulerConfig, extra_args), redis_url=redis_url, worker_address=address_of(worker),
                  host=host, port=port, **settings)
    try:
        cfg.validate()
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    sched = Scheduler(cfg).start()
    if ready_timeout is not None:
        try:
            sched.wait_ready(ready_timeout)
        except BaseException:
            sched.stop()
            raise
    return sched


class Stack:
    """A private redis-server, one worker process and the scheduler in this process (what `llmserve serve` runs,
    without restarts), for benchmarks and tests that look inside the driver. Files and logs go to `workdir` (a new
    temporary directory, removed by `stop`)."""

    def __init__(self, worker_args: Iterable = (), scheduler_args: Iterable = (), *,
                 worker_env: dict[str, str] | None = None, ready_timeout: float = 180.0):
        self.worker_args, self.scheduler_args = list(worker_args), list(scheduler_args)
        self.worker_env, self.ready_timeout = worker_env, ready_timeout
        self.workdir = ""
        self.redis_server: RedisServer | None = None
        self.worker: Proc | None = None
        self.scheduler: Scheduler | None = None

    @property
    def redis_url(self) -> str:
        return self.redis_server.url

    @property
    def driver(self):
        return self.scheduler.driver if self.scheduler is not None else None

    @property
    def address(self) -> str:
        return self.scheduler.address

    def start(self) -> Stack:
        try:
            self.workdir = tempfile.mkdtemp(prefix="llmserve-stack-")
            self.redis_server = start_redis(os.path.join(self.workdir, "redis"), wait=False)
            self.worker = start_worker(self.worker_args, env=self.worker_env, log_dir=self.workdir, wait=False)
            wait_ready(self.redis_server)  # the two start side by side; the worker takes longer
            wait_ready(self.worker, timeout=self.ready_timeout)
            self.scheduler = start_scheduler_in_process(self.redis_url, self.worker, self.scheduler_args,
                                                        ready_timeout=self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
        for proc in (self.worker, self.redis_server):
            if proc is not None:
                stop(proc, timeout=15)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
