"""Leading a pool: the lease, taking the pool over from Redis, and (re)connecting to its worker.

Only one scheduler drives a pool: it holds a lease key renewed by every commit, and each lease carries an increasing
fencing token that Redis scripts and the worker check. A new leader fences the worker first (a step the previous
leader still has in flight is then rejected), reloads the state, and resumes every running request by recompute.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import replace

from common.config import device_default
from common.validation import ConfigError, check_limits
from common.worker_protocol import MAX_SLOTS
from protos import worker_pb2 as wpb
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.state_pool import from_records
from scheduler_svc.driver.worker_client import WorkerClient, WorkerError
from scheduler_svc.ledger.store import LeaseLost, RedisLedger
from scheduler_svc.metrics import Metrics

__all__ = ["ConfigError", "Lease", "take_pool", "reconnect_worker", "worker_restarted"]

log = logging.getLogger("llmserve.scheduler")


class Lease:
    def __init__(self, ledger: RedisLedger, holder: str | None, ttl_ms: int, stall_limit_s: float = 600.0):
        self.ledger = ledger
        self.holder = holder or uuid.uuid4().hex[:12]
        self.ttl_ms = ttl_ms
        self.stall_limit_s = stall_limit_s  # the heartbeat stops renewing for a driver stuck longer than this
        self.token: int | None = None  # while leading
        self._last_progress = time.monotonic()  # when the driver last started an iteration (or took the lease)

    def acquire(self) -> int | None:
        self.progress()
        self.token = self.ledger.try_acquire_lease(self.holder, self.ttl_ms)
        return self.token

    def renew(self) -> None:
        if not self.ledger.renew_lease(self.holder, self.token, self.ttl_ms):
            raise LeaseLost()

    def release(self) -> None:
        if self.token is not None:
            with contextlib.suppress(Exception):
                self.ledger.release_lease(self.holder, self.token)

    def progress(self) -> None:
        """The driver is alive: called at the start of every iteration."""
        self._last_progress = time.monotonic()

    def start_heartbeat(self, stopping: threading.Event) -> None:
        """Commits renew the lease, but anything the driver thread waits on can outlast a short TTL on a loaded host:
        a worker step of thousands of prompt tokens, a slow worker probe while idle, the GIL held by the API's
        threads. While we lead and the driver made progress within `stall_limit_s` (the step timeout), the process
        is alive and still leads, so renew from here every third of the TTL. A driver stuck for longer lets the
        lease lapse, and a standby takes the pool over. A lost lease still fails the next commit."""
        period = self.ttl_ms / 3000

        def beat() -> None:
            while not stopping.wait(period):
                token = self.token
                if token is None or time.monotonic() - self._last_progress > self.stall_limit_s:
                    continue
                try:
                    self.ledger.renew_lease(self.holder, token, self.ttl_ms)
                except Exception:  # Redis down: the driver thread finds out and handles it
                    log.warning("could not renew the lease from the heartbeat", exc_info=True)

        threading.Thread(target=beat, name="lease", daemon=True).start()


def connect(ledger: RedisLedger, lease: Lease, worker: WorkerClient, stopping: threading.Event,
            metrics: Metrics | None = None) -> wpb.WorkerInfo | None:
    """Describe the worker until it answers (renewing our lease meanwhile) and record it in the registry. Returns
    None when stopping. `worker.info` is the new description; `worker.previous_epoch` what the registry had."""
    last_log = 0.0
    worker.reopen()
    while not stopping.is_set():
        try:
            info = worker.describe(timeout=5)
            break
        except WorkerError as e:
            if time.monotonic() - last_log > 10:
                log.info("waiting for worker %s over %s: %s", worker.address, "TLS" if worker.tls else "plaintext",
                         worker.connect_hint(e))
                last_log = time.monotonic()
            lease.renew()
            stopping.wait(0.5)
    else:
        return None
    prev = ledger.set_worker(lease.token, worker.address, info.epoch,
                             {"model": info.model.name, "num_blocks": info.num_blocks})
    if prev is not None and prev != info.epoch:
        log.info("worker epoch changed %s -> %s: its KV is gone, resuming by recompute", prev, info.epoch)
    worker.info, worker.previous_epoch = info, prev
    if metrics is not None:
        metrics.set_model_name(info.model.name or "model")
    return info


def take_pool(ledger: RedisLedger, lease: Lease, worker: WorkerClient, cfg, metrics: Metrics,
              stopping: threading.Event) -> tuple[SchedulerCore, int, int] | None:
    """Become the pool's leader: lease, worker, state from Redis. Returns the core, the fence step's id and the
    last step id the ledger holds; or None (another scheduler leads; or stopping)."""
    token = lease.acquire()
    if token is None:
        stopping.wait(lease.ttl_ms / 3000)
        return None
    info = connect(ledger, lease, worker, stopping, metrics)
    if info is None:
        return None
    if cfg.tokenizer is not None and cfg.tokenizer[1] > info.model.vocab_size:
        path, size = cfg.tokenizer
        raise ConfigError(f"--tokenizer {path} has {size} tokens, more than the model's vocabulary of "
                          f"{info.model.vocab_size}: prompts would contain token ids the model cannot embed; use "
                          "the model's own tokenizer (drop --tokenizer) or one with at most that many tokens")
    if info.fencing_token >= token:
        # The worker already took plans with this token or a newer one that this pool's counter never handed us
        # (Redis lost its data, the pool was flushed, or the worker drove another namespace): without a newer token
        # every plan would be rejected as fenced, and we would step down and retry forever.
        lease.token = ledger.advance_fence(lease.holder, token, info.fencing_token, lease.ttl_ms)
    ledger.durability.check(ledger.client)  # on every primary: a fail-over may promote one configured otherwise
    ledger.init_pool(info.num_blocks, info.block_size, info.num_state_slots)
    cfg.policy = sized_policy(cfg.policy, info)
    metrics.set_config(cfg.policy, num_gpu_blocks=info.num_blocks, kv_bytes_per_block=info.kv_bytes_per_block,
                       max_model_len=info.max_model_len, device=info.device)
    state = ledger.load()
    states = (from_records(info.num_state_slots, cfg.policy.max_state_snapshots, state.state_records)
              if info.num_state_slots else None)
    core = SchedulerCore(cfg.policy, state.pool, cfg.queue_timeout, state.arrival_seq, states)
    # Fence the worker first: from now on a step the previous leader still has in flight is rejected, and the reply
    # says whether the worker ran a step that never reached Redis (its KV writes are then unknown).
    step_id = max(state.step_id, info.last_step_id) + 1
    previous = worker.fence(step_id, lease.token)
    core.reset_worker = False
    # The cached blocks are valid only if this worker's KV is exactly what the ledger's last committed step left: a
    # step it ran that Redis never saw (previous > step_id) may have overwritten cached blocks, and one that has not
    # run the ledger's steps (previous < step_id: a restarted worker whose epoch the last leader recorded before its
    # commit dropped the hashes) never computed them.
    if previous != state.step_id or worker.previous_epoch != info.epoch:
        core.drop_cached()
    core.resume(state.requests)
    return core, step_id, state.step_id


def sized_policy(policy, info: wpb.WorkerInfo):
    """Fill the policy's unset limits from the worker: a smaller token budget on CPU than on a GPU."""
    # Static and naive batches prefill whole prompts whatever the budget, so only continuous mode without chunking
    # needs a budget that holds a whole prompt (vLLM's default then: at least max-model-len).
    whole_prompts_in_budget = policy.scheduling_mode == "continuous" and not policy.enable_chunked_prefill
    default_budget = device_default(SchedulerConfig, "max_num_batched_tokens", info.device)
    if whole_prompts_in_budget:
        default_budget = max(default_budget, info.max_model_len)
    max_num_seqs = policy.max_num_seqs or device_default(SchedulerConfig, "max_num_seqs", info.device)
    if info.num_state_slots:
        # Every running sequence of a hybrid model holds a state slot: no more can run than there are slots.
        max_num_seqs = min(max_num_seqs, info.num_state_slots)
    sized = replace(policy, block_size=info.block_size,
                    max_num_batched_tokens=policy.max_num_batched_tokens or default_budget,
                    max_num_seqs=max_num_seqs, num_state_slots=info.num_state_slots)
    check_limits(block_size=info.block_size, budget=sized.max_num_batched_tokens, max_model_len=info.max_model_len,
                 chunked=not whole_prompts_in_budget, budget_is_default=not policy.max_num_batched_tokens)
    if sized.max_num_seqs > MAX_SLOTS // 2:
        # Headroom: a request's slot is freed only when the next plan drops it or a result reports its finish.
        raise ConfigError(f"--max-num-seqs {sized.max_num_seqs} is above {MAX_SLOTS // 2}: the worker protocol "
                          f"addresses at most {MAX_SLOTS} requests by slot, twice --max-num-seqs at most")
    return sized


def reconnect_worker(ledger: RedisLedger, lease: Lease, worker: WorkerClient, core: SchedulerCore, step_id: int,
                     stopping: threading.Event) -> int:
    """After a failed step: wait for the worker (the same one, or a restart) and check it still fits the pool.
    Returns the step id to continue from."""
    epoch = worker.info.epoch
    info = connect(ledger, lease, worker, stopping)
    if info is None:
        return step_id
    if info.epoch != epoch:
        core.drop_cached()
    if info.num_blocks != core.pool.num_blocks or info.block_size != core.policy.block_size or \
            info.num_state_slots != core.policy.num_state_slots:
        raise RuntimeError("the worker came back with a different KV pool or state slot shape; restart the scheduler")
    return max(step_id, info.last_step_id)


def worker_restarted(ledger: RedisLedger, lease: Lease, worker: WorkerClient, core: SchedulerCore,
                     info: wpb.WorkerInfo) -> None:
    """An idle ping found a new epoch: its KV is gone, and with it every cached block."""
    core.drop_cached()
    worker.info = info
    ledger.set_worker(lease.token, worker.address, info.epoch, {"model": info.model.name,
                                                                "num_blocks": info.num_blocks})
    core.reset_worker = True
