"""The scheduler loop: drain the inbox, schedule, run the step on the worker, commit to Redis, publish, observe.

Threads: gRPC handlers call `submit` / `abort` / `lookup` (they touch only the inbox and the outbox, under one lock);
everything else runs on the single driver thread. A step's effects reach clients only after its Redis commit, so a
scheduler killed at any moment loses nothing a client has seen: the next leader reloads the state from Redis and
resumes the running requests on the worker by recompute (`leadership.py`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.scheduler import FINISH_REJECTED, SchedulerCore
from scheduler_svc.core.step_records import SchedulerOutput, StepRecord
from scheduler_svc.driver.frontend import AbortRequest, AddRequest, Frontend
from scheduler_svc.driver.observers import MetricsObserver, Observer, StepLogObserver, StepTimes, TracingObserver
from scheduler_svc.driver.outbox import Published
from scheduler_svc.driver.worker_client import (
    PlanRejected,
    StaleStep,
    WorkerClient,
    WorkerError,
    WorkerFenced,
    encode_plan,
)
from scheduler_svc.ledger import failover, leadership, redis_ha
from scheduler_svc.ledger.store import LeaseLost, LedgerBehind, RedisLedger
from scheduler_svc.metrics import Metrics

log = logging.getLogger("llmserve.scheduler")
_DEFAULTS = SchedulerConfig()
IDLE_PROBE_TIMEOUT_S = 2.0  # the idle driver's Describe of its worker
IDLE_PROBE_GRACE_S = 30.0  # late answers for this long (a busy host) before an idle worker counts as lost


@dataclass
class DriverConfig:
    """What the driver runs with: the settings (scheduler_svc/config.py, whose defaults these are) turned into
    objects, and two internal limits that are not settings."""

    policy: PolicyConfig
    worker_address: str
    max_num_queued_requests: int = _DEFAULTS.max_num_queued_requests
    queue_timeout: float = _DEFAULTS.queue_timeout  # seconds; 0 = wait forever
    lease_ttl_ms: int = _DEFAULTS.lease_ttl_ms
    reattach_timeout: float = _DEFAULTS.reattach_timeout  # a vLLM engine protocol stream outlives a stand-down
    debug_invariants: bool = _DEFAULTS.debug_invariants
    worker_token: str | None = None  # sent as `authorization: Bearer <token>` on every worker call
    step_log: str | None = None  # JSONL path: one line per executed step (benchmarks, tests)
    # Plan step k + 1 while step k runs, and commit and publish k while k + 1 runs (vLLM's async scheduling).
    async_scheduling: bool = _DEFAULTS.async_scheduling
    worker_credentials: object = None  # grpc.ChannelCredentials for TLS to the worker (--worker-tls-*); None = plain
    worker_server_name: str | None = None  # name expected in the worker's certificate (default: the address's host)
    tokenizer: tuple[str, int] | None = None  # --tokenizer (path, vocabulary size): must fit the model's vocabulary
    step_timeout: float = 600.0
    finished_ttl_s: int = 600


class Driver(Frontend):
    """The loop on its own thread; the gRPC threads use the `Frontend` methods."""

    def __init__(self, cfg: DriverConfig, ledger: RedisLedger, metrics: Metrics, holder: str | None = None):
        self.cfg = cfg
        self.ledger = ledger
        self.metrics = metrics
        super().__init__(cfg.max_num_queued_requests, lambda rid: self.ledger.get_request(rid),
                         lambda: len(self.core.waiting) if self.core else 0, lambda: self.lease.token is not None)
        self.worker = WorkerClient(cfg.worker_address, cfg.worker_credentials, cfg.worker_server_name,
                                   cfg.worker_token, cfg.step_timeout)
        self.lease = leadership.Lease(ledger, holder, cfg.lease_ttl_ms, cfg.step_timeout)
        self.core: SchedulerCore | None = None  # while leading
        self.step_id = 0
        self.in_flight: StepRecord | None = None  # pipelined: the step sent last, whose result is not applied yet
        self.last_committed: int | None = None  # the last step id this process committed (failover.py compares)
        self.ledger_holds: int | None = None  # the step id the ledger holds while we lead: each commit must follow it
        self._worker_answered = time.monotonic()  # the worker's last answer (a step's result, an idle probe)
        self.timings = StepTimes()
        self.step_stats = self.timings.stats
        self.tracer = TracingObserver()
        self.observers: list[Observer] = [MetricsObserver(metrics), self.timings,
                                          self.tracer]
        if cfg.step_log:
            self.observers.append(StepLogObserver(cfg.step_log, cfg.policy.scheduling_mode))
        self.thread = threading.Thread(target=self._run, name="driver", daemon=True)

    @property
    def worker_info(self):
        return self.worker.info

    # ---- called from gRPC threads ---------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.lease.start_heartbeat(self.stopping)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            for obs in self.observers:
                if isinstance(obs, StepLogObserver):
                    obs.close()

    # ---- the driver thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                if self.core is None:
                    self._lead()
                else:
                    self._iteration()
            except leadership.ConfigError as e:
                log.error("%s", e)
                self.fatal = str(e)
                self.stopping.set()
                break
            except LedgerBehind as e:
                log.warning("Redis lacks steps this scheduler committed (%s); taking the pool over again from what "
                            "it holds", e)
                self._step_down()
            except (LeaseLost, WorkerFenced) as e:
                log.warning("lost the lease on the pool (%s: %s); standing by", type(e).__name__, e)
                self._step_down()
            except Exception as e:
                if redis_ha.redis_unavailable(e):
                    log.warning("Redis cannot take writes (%s: %s); standing by, then taking the pool again from "
                                "the primary", type(e).__name__, e)
                elif isinstance(e, StaleStep) and self.core is None:
                    # Expected when two schedulers race for the pool: the other one's step reached the worker
                    # between our read of its state and our fence. Nothing was lost; the next attempt sees it.
                    log.info("take-over lost the race at the worker's fence (%s); standing by and retrying", e)
                else:
                    log.exception("scheduler iteration failed; standing by and retrying")
                self._step_down()
                time.sleep(0.5)
        if self.in_flight is not None and self.core is not None:  # stopping: finish the step sent last
            done, self.in_flight = self.in_flight, None
            try:
                self._finish_step(done, None)
            except Exception:
                log.warning("could not commit the last step while stopping; the next leader recomputes it",
                            exc_info=True)
        self._abandon_in_flight()
        self._notify("serving_stopped", self.outbox.end_all())  # left in Redis for the next leader
        self.lease.release()

    def _abandon_in_flight(self, timeout: float = 5.0) -> None:
        """Stop serving with a step sent but not applied: it is never committed (the next leader recomputes it);
        wait briefly so that its spans end and are exported."""
        record, self.in_flight = self.in_flight, None
        if record is not None:
            with contextlib.suppress(Exception):
                record.wait(timeout)
            record.worker_error = "abandoned"
            self._notify("step_failed", record)

    def _lead(self) -> None:
        led = leadership.take_pool(self.ledger, self.lease, self.worker, self.cfg, self.metrics, self.stopping)
        if led is None:
            return
        self.core, self.step_id, ledger_step = led
        self._worker_answered = time.monotonic()
        self.ledger_holds = ledger_step
        failover.report_behind(self.last_committed, ledger_step, self.ledger.prefix, self.metrics)
        self.tracer.model_name = self.worker.info.model.name
        self.tracer.token_budget = self.core.policy.max_num_batched_tokens
        # The fence step: the ledger's step id matches the worker's. Committed (and, with --redis-durability, made
        # durable) before anything read back from Redis is shown to clients.
        self._commit(self._record(SchedulerOutput()))
        with self.lock:
            for req in list(self.core.requests.values()):
                self.outbox.published[req.request_id] = Published.of_stored(req, False)
        log.info("leading pool %s with token %d: %d running, %d waiting requests resumed", self.ledger.prefix,
                 self.lease.token, len(self.core.running), len(self.core.waiting))
        self._set_ready(True)

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready.is_set():
            (self.ready.set if ready else self.ready.clear)()
            self.on_ready_change(ready and not self.draining.is_set())

    def _step_down(self) -> None:
        self._set_ready(False)
        self.core = None
        self._abandon_in_flight()
        self.lease.token = None
        with self.lock:  # an abort already answered "found" outlives the stand-down: the next lead applies it
            self.inbox = [c for c in self.inbox if isinstance(c, AbortRequest)]
        self._notify("serving_stopped", self.outbox.end_all())

    def _drain_inbox(self) -> None:
        with self.lock:
            commands, self.inbox = self.inbox, []
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                self.core.add(cmd.seqs)
                self._notify("requests_added", cmd.seqs)
            else:
                self.core.abort(cmd.request_id, cmd.reason)

    def _iteration(self) -> None:
        """One step. Pipelined (--async-scheduling): plan k + 1 is built and sent while step k runs (each request
        assumed to get its token in k); then k's result is applied, committed and published while k + 1 runs."""
        core = self.core
        self.lease.progress()
        self._drain_inbox()
        if not core.has_work and self.in_flight is None:
            if core.has_uncommitted:
                self._commit(self._record(SchedulerOutput()))
            elif self.wake.wait(self.cfg.lease_ttl_ms / 3000):
                self.wake.clear()
            else:
                self.lease.renew()
                self._check_worker()
            return
        record = self._send(core.schedule(time.time())) if core.has_work else None
        if record is None and self.in_flight is None:
            # Nothing fits this step (e.g. every block is held): commit what changed and wait for work.
            self._commit(self._record(SchedulerOutput()))
            self.wake.wait(0.05)
            self.wake.clear()
            return
        if self.cfg.async_scheduling:
            done, self.in_flight = self.in_flight, record
        else:
            done = record
        if done is not None:
            self._finish_step(done, also_changed=self.in_flight)

    def _send(self, out: SchedulerOutput) -> StepRecord | None:
        """Encode and send a scheduled step; None when it schedules nothing (its changes go with the next commit)."""
        if not out.scheduled:
            return None
        core = self.core
        self.step_id += 1
        record = self._record(out)
        plan = encode_plan(out, self.worker.slots, step_id=self.step_id, token=self.lease.token,
                           epoch=self.worker.info.epoch, reset=core.reset_worker, dropped=core.to_drop,
                           after_step_id=self.in_flight.step_id if self.in_flight else 0,
                           speculative=core.policy.speculative)
        core.reset_worker, core.to_drop = False, []
        self._notify("step_started", record)
        record.wait = self.worker.send(plan, record.trace)
        return record

    def _finish_step(self, record: StepRecord, also_changed: StepRecord | None) -> None:
        """Wait for an executed step, apply it, commit it, publish it. `also_changed`: the step sent after it."""
        try:
            record.worker = record.wait()
            self._worker_answered = time.monotonic()
        except WorkerError as e:
            record.worker_error = e.code.name
            self._notify("step_failed", record)
            if also_changed is not None:  # planned on top of the failed step: its outcome means nothing now
                self.in_flight = None
                self._notify("step_failed", also_changed)
                with contextlib.suppress(WorkerError):
                    also_changed.wait(self.cfg.step_timeout)
            self._worker_failed(e)
            return
        record.now = time.time()
        record.outcome = self.core.update_from_output(record.output, record.worker, record.now)
        self._commit(record, also_changed.output if also_changed is not None else None)

    def _record(self, out: SchedulerOutput) -> StepRecord:
        return StepRecord(step_id=self.step_id, output=out, start=time.perf_counter(), start_ns=time.time_ns(),
                          now=time.time())

    def _commit(self, record: StepRecord, also_changed: SchedulerOutput | None = None) -> None:
        """Write the step to Redis, then let clients see it, then tell the observers. `also_changed`: a later step
        already scheduled (its block allocations are in the pool's changes, so its requests' tables go in too)."""
        core, pool = self.core, self.core.pool
        commit = core.take_commit(record.step_id, record.output, record.outcome, self.cfg.debug_invariants,
                                  self.cfg.finished_ttl_s, also_changed, after_step_id=self.ledger_holds)
        if self.cfg.debug_invariants:
            core.check_invariant()
        t0 = time.perf_counter()
        try:
            self.ledger.commit_step(self.lease.holder, self.lease.token, self.cfg.lease_ttl_ms, commit)
        except Exception:
            self._notify("step_failed", record)
            raise
        self.last_committed = self.ledger_holds = record.step_id
        record.end = time.perf_counter()
        record.commit_seconds = record.end - t0
        record.finished = commit.finished
        self.outbox.publish(record.outcome.appended, commit.finished)
        record.num_running, record.num_waiting, record.kv_usage = len(core.running), len(core.waiting), pool.usage
        record.num_free_blocks, record.num_used_blocks = pool.num_free, pool.num_used
        if core.states is not None:
            states = core.states
            record.state_usage, record.num_state_snapshots = states.usage, states.num_snapshots
            record.state_snapshot_share = states.snapshot_share
        self._notify("step_committed", record)

    def _worker_failed(self, err: WorkerError) -> None:
        if isinstance(err, WorkerFenced):
            raise err
        if isinstance(err, PlanRejected) and err.request_id in self.core.requests:
            # One request is at fault and nothing of the plan ran: it fails alone, the others are recomputed on a
            # fresh batch (their cached blocks make that cheap) and this scheduler keeps its lease.
            log.warning("the worker rejected request %s: %s", err.request_id, err)
            self.core.abort(err.request_id, FINISH_REJECTED, str(err))
            self.core.worker_lost()
            return
        log.warning("worker step failed (%s: %s); resuming its requests by recompute", err.code.name, err)
        self.core.worker_lost()
        self._set_ready(False)
        self.step_id = leadership.reconnect_worker(self.ledger, self.lease, self.worker, self.core, self.step_id,
                                                   self.stopping)
        self._worker_answered = time.monotonic()
        self._set_ready(True)

    def _check_worker(self) -> None:
        """While idle, notice a dead or restarted worker, so health says NOT_SERVING instead of queueing work."""
        try:
            info = self.worker.describe(timeout=IDLE_PROBE_TIMEOUT_S)
        except WorkerError as e:
            silent = time.monotonic() - self._worker_answered
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and silent < IDLE_PROBE_GRACE_S:
                # Late, not gone (an overloaded host): declaring it lost would refuse every request that arrives
                # until it answers again; they queue instead.
                log.info("the idle worker did not answer within %g s (silent for %.0f s); still serving",
                         IDLE_PROBE_TIMEOUT_S, silent)
                return
            self._worker_failed(e)
            return
        self._worker_answered = time.monotonic()
        if info.epoch != self.worker.info.epoch:
            leadership.worker_restarted(self.ledger, self.lease, self.worker, self.core, info)

    def _notify(self, hook: str, arg) -> None:
        for obs in self.observers:
            getattr(obs, hook)(arg)
