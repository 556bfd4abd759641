"""The scheduler loop: one iteration = drain inbox, schedule, ExecuteStep on the worker, commit to Redis, publish.

Threads: gRPC handlers call `submit` / `abort` / `attach` (they only touch the inbox and the published
outputs, under `self.lock`); everything else runs on the single engine thread. A step's effects reach clients
only after its Redis commit, so a scheduler killed at any moment loses nothing a client has seen: the next
leader reloads the mirror from Redis and resumes the running requests on the worker by recompute.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import grpc

from common import tls, tracing
from common.auth import with_worker_token
from common.validation import ConfigError, check_limits
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.metrics import Metrics
from scheduler_svc.policy import PolicyConfig, StepSchedule, schedule
from scheduler_svc.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, Status
from scheduler_svc.store import LeaseLost, RedisLedger, StepCommit

log = logging.getLogger("llmserve.scheduler")

FINISH_TIMEOUT = "timeout"  # queue timeout: the stream ends with DEADLINE_EXCEEDED
_WORKER_FINISH = {wpb.FINISH_REASON_EOS: FINISH_STOP, wpb.FINISH_REASON_STOP_TOKEN: FINISH_STOP,
                  wpb.FINISH_REASON_MAX_TOKENS: FINISH_LENGTH}
_MAX_FINISHED_KEPT = 10_000


@dataclass
class EngineConfig:
    policy: PolicyConfig
    worker_address: str
    max_num_queued_requests: int = 10_000
    queue_timeout: float = 0.0  # seconds; 0 = wait forever
    lease_ttl_ms: int = 5000
    debug_invariants: bool = False
    step_timeout: float = 600.0
    finished_ttl_s: int = 600
    worker_token: str | None = None  # sent as `authorization: Bearer <token>` on every worker call
    step_log: str | None = None  # JSONL path: one line per executed step (benchmarks, tests)
    worker_credentials: grpc.ChannelCredentials | None = None  # TLS to the worker (--worker-tls-*); None = plaintext
    worker_server_name: str | None = None  # name expected in the worker's certificate (default: the address's host)


@dataclass
class Published:
    """What clients may see of one request: committed tokens only."""

    request: Request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[wpb.SampledToken | None] = field(default_factory=list)
    finish_reason: str | None = None


class SubmitError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class StepStats:
    wall: float
    worker: float
    commit: float
    running: int
    tokens: int


class Engine:
    def __init__(self, cfg: EngineConfig, ledger: RedisLedger, metrics: Metrics, holder: str | None = None):
        self.cfg = cfg
        self.ledger = ledger
        self.metrics = metrics
        self.holder = holder or uuid.uuid4().hex[:12]
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified after each commit
        self.published: OrderedDict[str, Published] = OrderedDict()
        self.inbox: list[tuple[str, object]] = []
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.ready = threading.Event()  # leader with a live worker
        self.draining = threading.Event()  # shutting down: no new requests
        self.fatal: str | None = None  # settings that cannot work with this worker (the process exits)
        self.on_ready_change = lambda ready: None
        # Engine-thread state.
        self.token: int | None = None
        self.worker: wpb_grpc.WorkerStub | None = None
        self.worker_info: wpb.WorkerInfo | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pool: BlockPool | None = None
        self.step_id = 0
        self.arrival_seq = 0
        self.reset_worker = True
        self.to_drop: list[str] = []
        self.pending_new: list[Request] = []
        self.pending_finished: list[Request] = []
        self.pending_updated: list[Request] = []  # state changes made outside a step (requeues, forks)
        self.forks: dict[str, list[Request]] = {}  # first sequence id -> siblings waiting for its prompt KV
        self.previous_epoch: str | None = None
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)
        self.step_log = open(cfg.step_log, "a", buffering=1) if cfg.step_log else None
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.step_started: float | None = None  # monotonic start of the worker call in flight
        self.heartbeat = threading.Thread(target=self._keep_lease_during_steps, name="lease", daemon=True)

    # ---- called from gRPC threads ---------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.heartbeat.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=30)
        if self.step_log is not None and not self.thread.is_alive():
            self.step_log.close()

    def drain(self, timeout: float) -> int:
        """Stop admitting; let requests in flight finish for up to `timeout` seconds, then abort the rest.
        Returns how many were aborted. With timeout 0 nothing is aborted: the requests stay in Redis and the next
        leader resumes them (clients re-attach by request id)."""
        self.draining.set()
        self.on_ready_change(False)
        if timeout <= 0:
            return 0
        deadline = time.monotonic() + timeout

        def unfinished() -> list[str]:
            with self.lock:
                return [rid for rid, p in self.published.items() if p.finish_reason is None]

        while unfinished() and time.monotonic() < deadline and self.token is not None:
            time.sleep(0.1)
        left = unfinished()
        for rid in left:
            self.abort(rid, FINISH_ABORT)
        end = time.monotonic() + 10
        while unfinished() and time.monotonic() < end and self.token is not None:
            time.sleep(0.05)  # the aborts are committed at the next iteration boundary
        return len(left)

    def lookup(self, rid: str) -> Published | None:
        with self.lock:
            pub = self.published.get(rid)
        if pub is not None or not self.ready.is_set():
            return pub
        # Not in memory: a request finished before this scheduler started (kept in Redis for a while).
        req = self.ledger.get_request(rid)
        if req is None:
            return None
        pub = Published(req, list(req.output_ids), [None] * len(req.output_ids),
                        req.finish_reason if req.finished else None)
        with self.lock:
            return self.published.setdefault(rid, pub)

    def submit(self, reqs: list[Request]) -> list[Published]:
        """Queue the sequences of one request (n > 1: siblings fork from the first), or return the existing ones."""
        with self.lock:
            if self.draining.is_set():
                raise SubmitError(grpc.StatusCode.UNAVAILABLE, "this scheduler is shutting down (draining); "
                                  "retry on another scheduler or after the restart")
            if not self.ready.is_set():
                raise SubmitError(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet "
                                  "(or it is a standby); retry shortly")
            if reqs[0].request_id in self.published:
                return [self.published[r.request_id] for r in reqs if r.request_id in self.published]
            queued = len(self.waiting) + sum(1 for kind, _ in self.inbox if kind == "add")
            if queued >= self.cfg.max_num_queued_requests:
                raise SubmitError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"the waiting queue is full: {queued} requests queued, "
                                  f"--max-num-queued-requests is {self.cfg.max_num_queued_requests}")
            pubs = []
            for req in reqs:
                pubs.append(Published(req))
                self.published[req.request_id] = pubs[-1]
            self.inbox.append(("add", reqs))
        self.wake.set()
        return pubs

    def abort(self, rid: str, reason: str = FINISH_ABORT) -> bool:
        with self.lock:
            pub = self.published.get(rid)
            if pub is None or pub.finish_reason is not None:
                return pub is not None
            self.inbox.append(("abort", (rid, reason)))
        self.wake.set()
        return True

    # ---- the engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                if self.token is None:
                    self._become_leader()
                else:
                    self._iteration()
            except ConfigError as e:
                log.error("%s", e)
                self.fatal = str(e)
                self.stopping.set()
                break
            except LeaseLost:
                log.warning("lost the lease on the pool; standing by")
                self._step_down()
            except Exception:
                log.exception("engine iteration failed; standing by and retrying")
                self._step_down()
                time.sleep(0.5)
        with self.lock:
            self._end_open_spans()  # requests left in Redis for the next leader (e.g. --shutdown-timeout 0)
        if self.token is not None:
            try:
                self.ledger.release_lease(self.holder, self.token)
            except Exception:
                pass

    def _end_open_spans(self) -> None:
        """This process stops serving its requests (lost lease, shutdown): end their spans so they get exported."""
        now = time.time()
        for pub in self.published.values():
            if pub.request.span is not None:
                _end_request_span(pub.request, now, "unavailable")

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready.is_set():
            (self.ready.set if ready else self.ready.clear)()
            self.on_ready_change(ready and not self.draining.is_set())

    def _step_down(self) -> None:
        self._set_ready(False)
        self.token = None
        with self.lock:
            # Streams of this process end; clients re-attach to the new leader by request id.
            for pub in self.published.values():
                if pub.finish_reason is None:
                    pub.finish_reason = "unavailable"
            self._end_open_spans()
            self.published.clear()
            self.inbox.clear()
            self.changed.notify_all()

    def _become_leader(self) -> None:
        token = self.ledger.try_acquire_lease(self.holder, self.cfg.lease_ttl_ms)
        if token is None:
            self.stopping.wait(self.cfg.lease_ttl_ms / 3000)
            return
        self.token = token
        info = self._connect_worker()
        if info is None:
            return
        if info.fencing_token >= token:
            # The worker already took plans with this token or a newer one that this pool's counter never handed
            # us (Redis lost its data, the pool was flushed, or the worker drove another namespace): without a
            # newer token every plan would be rejected as fenced, and we would step down and retry forever.
            token = self.token = self.ledger.advance_fence(self.holder, token, info.fencing_token,
                                                           self.cfg.lease_ttl_ms)
        self.ledger.init_pool(info.num_blocks, info.block_size)
        self._size_policy(info)
        state = self.ledger.load()
        self.pool = state.pool
        self.arrival_seq = state.arrival_seq
        self.waiting.clear()
        self.running.clear()
        self.to_drop.clear()
        self.pending_new.clear()
        self.pending_finished.clear()
        self.pending_updated.clear()
        self.forks.clear()
        # Fence the worker first: from now on a step the previous leader still has in flight is rejected, and the
        # reply says whether the worker ran a step that never reached Redis (its KV writes are then unknown).
        fence = wpb.StepPlan(step_id=max(state.step_id, info.last_step_id) + 1, fencing_token=self.token,
                             expected_epoch=info.epoch, reset_batch=True)
        previous = self.worker.ExecuteStep(fence, timeout=30).previous_step_id
        self.step_id = fence.step_id
        self.reset_worker = False
        # The cached blocks are valid only if this worker's KV is exactly what the ledger's last committed step left:
        # a step it ran that Redis never saw (previous > step_id) may have overwritten cached blocks, and one that
        # has not run the ledger's steps (previous < step_id: a restarted worker whose epoch the last leader recorded
        # before its commit dropped the hashes) never computed them.
        if previous != state.step_id or self.previous_epoch != info.epoch:
            self.pool.drop_all_hashes()
        with self.lock:
            for req in state.requests:
                (self.running if req.status == Status.RUNNING else self.waiting).append(req)
                self.published[req.request_id] = Published(req, list(req.output_ids), [None] * len(req.output_ids))
        # The worker holds none of them now: requeue the running ones; their cached blocks make recompute cheap.
        self._requeue_running()
        # Commit the fence step at once: the ledger's step_id then matches the worker's, so a next leader (this one
        # killed before any other step) still trusts the cache instead of dropping it.
        self._commit(StepSchedule(), {}, time.perf_counter(), 0.0)
        log.info("leading pool %s with token %d: %d running, %d waiting requests resumed", self.ledger.prefix,
                 token, len(self.running), len(self.waiting))
        self._set_ready(True)

    def _size_policy(self, info: wpb.WorkerInfo) -> None:
        """Fill the policy's unset limits from the worker: a smaller token budget on CPU than on a GPU."""
        pol, gpu = self.cfg.policy, info.device.startswith("cuda")
        # Static and naive batches prefill whole prompts whatever the budget, so only continuous mode without
        # chunking needs a budget that holds a whole prompt (vLLM's default then: at least max-model-len).
        whole_prompts_in_budget = pol.scheduling_mode == "continuous" and not pol.enable_chunked_prefill
        default_budget = 8192 if gpu else 512
        if whole_prompts_in_budget:
            default_budget = max(default_budget, info.max_model_len)
        self.cfg.policy = replace(pol, block_size=info.block_size,
                                  max_num_batched_tokens=pol.max_num_batched_tokens or default_budget,
                                  max_num_seqs=pol.max_num_seqs or (256 if gpu else 64))
        check_limits(block_size=info.block_size, budget=self.cfg.policy.max_num_batched_tokens,
                     max_model_len=info.max_model_len, chunked=not whole_prompts_in_budget,
                     budget_is_default=not pol.max_num_batched_tokens)
        self.metrics.set_config(self.cfg.policy, num_gpu_blocks=info.num_blocks,
                                kv_bytes_per_block=info.kv_bytes_per_block, max_model_len=info.max_model_len,
                                device=info.device)

    def _connect_worker(self) -> wpb.WorkerInfo | None:
        """Describe the worker until it answers (renewing our lease meanwhile); record it in the registry."""
        channel = tls.open_channel(self.cfg.worker_address, self.cfg.worker_credentials, self.cfg.worker_server_name,
                                   options=[("grpc.max_send_message_length", 256 << 20),
                                            ("grpc.max_receive_message_length", 256 << 20)])
        stub = wpb_grpc.WorkerStub(with_worker_token(channel, self.cfg.worker_token))
        last_log = 0.0
        while not self.stopping.is_set():
            try:
                info = stub.Describe(wpb.DescribeRequest(), timeout=5)
                break
            except grpc.RpcError as e:
                if time.monotonic() - last_log > 10:
                    # The details carry TLS handshake failures (untrusted certificate, plaintext vs TLS).
                    log.info("waiting for worker %s over %s: %s: %s%s", self.cfg.worker_address,
                             "plaintext" if self.cfg.worker_credentials is None else "TLS", e.code().name, e.details(),
                             tls.closed_hint(e.details(), self.cfg.worker_credentials is not None))
                    last_log = time.monotonic()
                if not self.ledger.renew_lease(self.holder, self.token, self.cfg.lease_ttl_ms):
                    raise LeaseLost() from None
                self.stopping.wait(0.5)
        else:
            return None
        prev = self.ledger.set_worker(self.token, self.cfg.worker_address, info.epoch,
                                      {"model": info.model.name, "num_blocks": info.num_blocks})
        self.previous_epoch = prev
        if prev is not None and prev != info.epoch:
            log.info("worker epoch changed %s -> %s: its KV is gone, resuming by recompute", prev, info.epoch)
        self.worker, self.worker_info = stub, info
        self.metrics.set_model_name(info.model.name or "model")
        return info

    def _drain_inbox(self, now: float) -> None:
        with self.lock:
            commands, self.inbox = self.inbox, []
        for kind, arg in commands:
            if kind == "add":
                first, *siblings = arg
                for req in arg:
                    self.arrival_seq += 1
                    req.arrival_seq = self.arrival_seq
                    self.pending_new.append(req)
                    if tracing.enabled:
                        self._start_request_span(req)
                self.waiting.append(first)
                if siblings:
                    self.forks[first.request_id] = siblings
            else:
                rid, reason = arg
                req = self._find(rid)
                if req is not None:
                    self._finish(req, reason, now)
        if self.cfg.queue_timeout > 0:
            for req in [r for r in self.waiting if r.scheduled_time is None
                        and now - r.arrival_time > self.cfg.queue_timeout]:
                self._finish(req, FINISH_TIMEOUT, now)

    def _find(self, rid: str) -> Request | None:
        with self.lock:
            pub = self.published.get(rid)
        return pub.request if pub is not None and not pub.request.finished else None

    def _finish(self, req: Request, reason: str, now: float) -> None:
        """The one path that frees a request: finish, abort, timeout. Idempotent."""
        if req.finished:
            return
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req.fork_of in self.forks:
            self.forks[req.fork_of].remove(req)
        self._release_forks(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        if req.on_worker:
            self.to_drop.append(req.request_id)
            req.on_worker = False
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.pending_finished.append(req)
        self.metrics.request_finished(req, now)
        if req.span is not None:
            _end_request_span(req, now)

    def _iteration(self) -> None:
        now = time.time()
        self._drain_inbox(now)
        if not self.running and not self.waiting:
            if self.pending_new or self.pending_finished or self.pending_updated:
                self._commit(StepSchedule(), {}, time.perf_counter(), 0.0)
                return
            if self.wake.wait(self.cfg.lease_ttl_ms / 3000):
                self.wake.clear()
                return
            if not self.ledger.renew_lease(self.holder, self.token, self.cfg.lease_ttl_ms):
                raise LeaseLost()
            self._ping_worker()
            return
        t0 = time.perf_counter()
        t0_ns = time.time_ns() if tracing.enabled else 0
        sched = schedule(self.waiting, self.running, self.pool, self.cfg.policy)
        for req in sched.preempted:
            if req.on_worker:
                self.to_drop.append(req.request_id)
                req.on_worker = False
        self.metrics.preempted(len(sched.preempted))
        if self.cfg.policy.enable_prefix_caching:
            self.metrics.prefix_cache(sum(r.num_tokens for r in sched.admitted),
                                      sum(r.num_cached_tokens for r in sched.admitted))
        if not sched.scheduled:
            # Nothing fits this step (e.g. every block is held): commit what changed and wait for work.
            self._commit(sched, {}, t0, 0.0)
            self.wake.wait(0.05)
            self.wake.clear()
            return
        plan = self._build_plan(sched)
        span = self._start_iteration_span(sched, t0_ns) if tracing.enabled else None
        self.step_started = time.monotonic()
        try:
            if span is None:
                result = self.worker.ExecuteStep(plan, timeout=self.cfg.step_timeout)
            else:
                result = self._traced_execute(plan, span)
        except grpc.RpcError as e:
            if span is not None:
                span.set_attribute("llmserve.worker.error", e.code().name)
                span.end()
            self._worker_failed(e, sched)
            return
        finally:
            self.step_started = None
        worker_time = result.prepare_seconds + result.forward_seconds + result.sample_seconds
        appended: dict[str, list[wpb.SampledToken]] = {}
        now = time.time()
        caching = self.cfg.policy.enable_prefix_caching
        for req in sched.scheduled:
            req.num_computed_tokens += sched.num_tokens[req.request_id]
            if caching:
                self._register_computed_blocks(req)
            if req.request_id in self.forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork(req)
            if req.scheduled_time is None:
                req.scheduled_time = now
                self.metrics.request_scheduled(req, now)
        # Tokens only come for this step's requests: look them up here, not through `published` under the lock
        # the stream threads contend for (one acquisition per token, 256 a step at 256 running).
        by_id = {r.request_id: r for r in sched.scheduled}
        for tok in result.tokens:
            req = by_id.get(tok.request_id)
            if req is None or req.finished:
                continue
            req.output_ids.append(tok.token_id)
            appended.setdefault(req.request_id, []).append(tok)
            self.metrics.token_generated(req, now)
            if req.first_token_time is None:
                req.first_token_time = now
                if req.span is not None:
                    req.span.add_event("first token", timestamp=int(now * 1e9))
            if tok.finish_reason:
                req.on_worker = False  # the worker forgot it already
                self._finish(req, _WORKER_FINISH[tok.finish_reason], now)
        try:
            self._commit(sched, appended, t0, worker_time)
        except Exception as e:
            if span is not None:  # e.g. the lease was lost: still export the step's span, marked
                span.set_attribute("llmserve.commit.error", type(e).__name__)
                span.end()
            raise
        self.metrics.step_done(sched, len(self.running), len(self.waiting), self.pool.usage)
        if self.step_log is not None:
            self._log_step(sched, now)
        if span is not None:
            self._end_iteration_span(span, sched)

    def _keep_lease_during_steps(self) -> None:
        """Each commit renews the lease, but one worker step can outlast the TTL (a static batch or an unchunked
        prompt of thousands of tokens on a CPU). While the engine thread waits on such a step the process is alive
        and still leads, so renew from here; a lost lease still fails the step's commit."""
        period = self.cfg.lease_ttl_ms / 3000
        while not self.stopping.wait(period):
            started, token = self.step_started, self.token
            if started is None or token is None or time.monotonic() - started < period:
                continue
            try:
                self.ledger.renew_lease(self.holder, token, self.cfg.lease_ttl_ms)
            except Exception:  # Redis down: the engine thread finds out and handles it
                log.warning("could not renew the lease during a long step", exc_info=True)

    def _log_step(self, sched: StepSchedule, now: float) -> None:
        record = {"step": self.step_id, "time": now, "mode": self.cfg.policy.scheduling_mode,
                  "scheduled": sched.num_tokens, "admitted": [r.request_id for r in sched.admitted],
                  "preempted": [r.request_id for r in sched.preempted],
                  "finished": [r.request_id for r in sched.scheduled if r.finished],
                  "running": len(self.running), "waiting": len(self.waiting), "kv_usage": self.pool.usage}
        self.step_log.write(json.dumps(record) + "\n")

    # ---- tracing (called only while tracing.enabled) ------------------------------------------------------------

    def _start_request_span(self, req: Request) -> None:
        s = req.sampling
        model = self.worker_info.model.name if self.worker_info is not None else ""
        attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": model,
                 "gen_ai.request.max_tokens": s.max_tokens, "llmserve.request_id": req.request_id,
                 "gen_ai.usage.input_tokens": req.num_prompt_tokens, "gen_ai.request.temperature": s.temperature,
                 "gen_ai.request.top_p": s.top_p}
        req.span = tracing.tracer.start_span(f"text_completion {model}".strip(), context=req.trace_context,
                                             start_time=int(req.arrival_time * 1e9), attributes=attrs)

    def _start_iteration_span(self, sched: StepSchedule, t0_ns: int):
        prefill = decode = 0
        for req in sched.scheduled:
            n = sched.num_tokens[req.request_id]
            if n == 1 and req.num_computed_tokens == req.num_tokens - 1 and req.output_ids:
                decode += 1
            else:
                prefill += n
        span = tracing.tracer.start_span("llmserve.iteration", start_time=t0_ns, attributes={
            "llmserve.step.id": self.step_id, "llmserve.step.prefill_tokens": prefill,
            "llmserve.step.decode_seqs": decode, "llmserve.step.scheduled_seqs": len(sched.scheduled),
            "llmserve.step.preemptions": len(sched.preempted), "llmserve.step.tokens": sched.total_tokens,
            "llmserve.step.token_budget": self.cfg.policy.max_num_batched_tokens})
        now_ns = time.time_ns()
        for req in sched.admitted:
            if req.span is not None:
                req.span.add_event("scheduled", {"llmserve.step.id": self.step_id,
                                                 "llmserve.cached_tokens": req.num_cached_tokens}, now_ns)
        for req in sched.preempted:
            if req.span is not None:
                req.span.add_event("preempted", {"llmserve.step.id": self.step_id}, now_ns)
        return span

    def _traced_execute(self, plan: wpb.StepPlan, parent) -> wpb.StepResult:
        from opentelemetry.trace import SpanKind

        span = tracing.tracer.start_span("llmserve.worker/ExecuteStep", context=tracing.context_with(parent),
                                         kind=SpanKind.CLIENT, attributes={"rpc.system": "grpc",
                                                                           "rpc.service": "llmserve.worker.v1.Worker",
                                                                           "rpc.method": "ExecuteStep",
                                                                           "llmserve.step.id": plan.step_id})
        try:
            result = self.worker.ExecuteStep(plan, timeout=self.cfg.step_timeout, metadata=tracing.inject(span))
        except grpc.RpcError as e:
            span.set_attribute("rpc.grpc.status_code", e.code().value[0])
            raise
        finally:
            span.end()
        parent.set_attributes({"llmserve.worker.prepare_seconds": result.prepare_seconds,
                               "llmserve.worker.forward_seconds": result.forward_seconds,
                               "llmserve.worker.sample_seconds": result.sample_seconds})
        return result

    def _end_iteration_span(self, span, sched: StepSchedule) -> None:
        stats = self.step_stats[-1] if self.step_stats else None
        span.set_attributes({"llmserve.num_running": len(self.running), "llmserve.num_waiting": len(self.waiting),
                             "llmserve.kv.free_blocks": self.pool.num_free,
                             "llmserve.kv.used_blocks": self.pool.num_used,
                             "llmserve.redis.commit_seconds": stats.commit if stats is not None else 0.0})
        span.end()

    def _release_forks(self, first: Request) -> None:
        """Siblings that can no longer fork from `first` queue on their own (the prefix cache still helps)."""
        siblings = self.forks.pop(first.request_id, None)
        if siblings:
            self.waiting.extend(siblings)

    def _fork(self, first: Request) -> None:
        """n > 1: the first sequence's prompt KV is computed; its siblings share those blocks and each computes
        only the last prompt token (into a copy-on-write block) to sample its own first token."""
        siblings = self.forks.pop(first.request_id)
        if len(self.running) + len(siblings) > self.cfg.policy.max_num_seqs:
            self.waiting.extend(siblings)
            return
        table = first.block_ids[: -(-first.num_prompt_tokens // self.cfg.policy.block_size)]
        for sib in siblings:
            self.pool.take(table)
            sib.block_ids = list(table)
            sib.num_computed_tokens = sib.num_prompt_tokens - 1
            sib.status = Status.RUNNING
            self.running.append(sib)
            self.pending_updated.append(sib)

    def _requeue_running(self) -> None:
        """Preempt every running request to the front of the queue, in order (the worker lost or forgot them)."""
        for req in reversed(self.running):
            self.pool.release(req.block_ids)
            req.block_ids = []
            req.num_computed_tokens = 0
            req.num_registered_blocks = 0
            req.status = Status.WAITING
            req.on_worker = False
            self.waiting.appendleft(req)
            self.pending_updated.append(req)
        self.running.clear()

    def _register_computed_blocks(self, req: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix-cache index."""
        bs = self.cfg.policy.block_size
        full = min(req.num_computed_tokens // bs, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        hashes = req.full_block_hashes(bs)
        tokens = req.all_token_ids
        for i in range(req.num_registered_blocks, full):
            self.pool.register(req.block_ids[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
        req.num_registered_blocks = full

    def _ping_worker(self) -> None:
        """While idle, notice a dead or restarted worker, so health says NOT_SERVING instead of queueing work."""
        try:
            info = self.worker.Describe(wpb.DescribeRequest(), timeout=2)
        except grpc.RpcError as e:
            self._worker_failed(e, StepSchedule())
            return
        if info.epoch != self.worker_info.epoch:
            # A restarted worker (new epoch): its KV is gone, and with it every cached block.
            self.pool.drop_all_hashes()
            self.worker_info = info
            self.ledger.set_worker(self.token, self.cfg.worker_address, info.epoch,
                                   {"model": info.model.name, "num_blocks": info.num_blocks})
            self.reset_worker = True

    def _build_plan(self, sched: StepSchedule) -> wpb.StepPlan:
        self.step_id += 1
        plan = wpb.StepPlan(step_id=self.step_id, fencing_token=self.token, expected_epoch=self.worker_info.epoch,
                            reset_batch=self.reset_worker, dropped_request_ids=self.to_drop)
        if self.reset_worker:
            for req in self.running + list(self.waiting):
                req.on_worker = False
        self.reset_worker = False
        self.to_drop = []
        plan.copy_blocks.extend(wpb.BlockCopy(src=src, dst=dst) for src, dst in sched.copies)
        for req in sched.scheduled:
            n = sched.num_tokens[req.request_id]
            if req.on_worker and req.request_id in sched.replaced_tables:
                plan.cached_requests.add(request_id=req.request_id, block_table=req.block_ids, num_scheduled_tokens=n)
            elif req.on_worker:
                plan.cached_requests.add(request_id=req.request_id, new_block_ids=sched.new_blocks[req.request_id],
                                         num_scheduled_tokens=n)
            elif req.output_ids:
                plan.resumed_requests.add(
                    request_id=req.request_id, token_ids=req.all_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                    sampling=req.sampling, block_ids=req.block_ids, num_computed_tokens=req.num_computed_tokens,
                    num_scheduled_tokens=n)
            else:
                plan.new_requests.add(
                    request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=req.sampling,
                    block_ids=req.block_ids, num_computed_tokens=req.num_computed_tokens, num_scheduled_tokens=n)
            req.on_worker = True
        return plan

    def _worker_failed(self, err: grpc.RpcError, sched: StepSchedule) -> None:
        code = err.code()
        if code == grpc.StatusCode.FAILED_PRECONDITION and "fencing_token" in (err.details() or ""):
            raise LeaseLost()
        log.warning("worker step failed (%s: %s); resuming its requests by recompute", code.name, err.details())
        # Whatever the worker did with this step is unknown: requeue every running request for recompute. Blocks
        # registered in the cache index were computed by committed steps and are only lost with a new epoch.
        self._requeue_running()
        self.reset_worker = True
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise RuntimeError(f"worker rejected a plan: {err.details()}")
        self._set_ready(False)
        epoch = self.worker_info.epoch
        info = self._connect_worker()
        if info is not None:
            if info.epoch != epoch:
                self.pool.drop_all_hashes()
            if info.num_blocks != self.pool.num_blocks or info.block_size != self.cfg.policy.block_size:
                raise RuntimeError("the worker came back with a different KV pool shape; restart the scheduler")
            self.step_id = max(self.step_id, info.last_step_id)
            self._set_ready(True)

    def _commit(self, sched: StepSchedule, appended: dict[str, list[wpb.SampledToken]], t0: float,
                worker_time: float) -> None:
        finished_ids = {r.request_id for r in self.pending_finished}
        changed = self.pending_updated + sched.scheduled + sched.preempted
        self.pending_updated = []
        updated = list({r.request_id: r for r in changed if r.request_id not in finished_ids}.values())
        commit = StepCommit(
            step_id=self.step_id, arrival_seq=self.arrival_seq, new_requests=self.pending_new, updated=updated,
            appended={rid: [t.token_id for t in toks] for rid, toks in appended.items()},
            finished=self.pending_finished, block_changes=self.pool.take_changes(),
            check_invariant=self.cfg.debug_invariants, finished_ttl_s=self.cfg.finished_ttl_s)
        if self.cfg.debug_invariants:
            self.pool.check([r.block_ids for r in self.running] + [r.block_ids for r in self.waiting])
        tc = time.perf_counter()
        self.ledger.commit_step(self.holder, self.token, self.cfg.lease_ttl_ms, commit)
        t1 = time.perf_counter()
        finished, self.pending_new, self.pending_finished = self.pending_finished, [], []
        with self.lock:
            for rid, toks in appended.items():
                pub = self.published.get(rid)
                if pub is not None:
                    pub.token_ids.extend(t.token_id for t in toks)
                    pub.logprobs.extend(t if t.HasField("logprob") else None for t in toks)
            for req in finished:
                pub = self.published.get(req.request_id)
                if pub is not None:
                    pub.finish_reason = req.finish_reason
                    self.published.move_to_end(req.request_id)
            while len(self.published) > _MAX_FINISHED_KEPT and self._oldest_is_finished():
                self.published.popitem(last=False)
            self.changed.notify_all()
        if sched.scheduled:
            self.step_stats.append(StepStats(t1 - t0, worker_time, t1 - tc, len(self.running), sched.total_tokens))

    def _oldest_is_finished(self) -> bool:
        oldest = next(iter(self.published.values()))
        return oldest.finish_reason is not None


def _end_request_span(req: Request, now: float, reason: str | None = None) -> None:
    span, req.span = req.span, None
    attrs = {"gen_ai.usage.input_tokens": req.num_prompt_tokens, "gen_ai.usage.output_tokens": len(req.output_ids),
             "gen_ai.response.finish_reasons": [reason or req.finish_reason or "unknown"],
             "llmserve.num_preemptions": req.num_preemptions}
    if req.first_token_time is not None:
        attrs["gen_ai.latency.time_to_first_token"] = max(0.0, req.first_token_time - req.arrival_time)
    if req.scheduled_time is not None:
        attrs["gen_ai.latency.time_in_queue"] = max(0.0, req.scheduled_time - req.arrival_time)
    span.set_attributes(attrs)
    span.end(end_time=int(now * 1e9))
