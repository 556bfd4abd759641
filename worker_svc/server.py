"""The worker's gRPC server: Describe, ExecuteStep, grpc.health.v1 and reflection.

With worker_svc/wire.py (the conversions to and from protos/worker.proto) the only worker module that speaks
protobuf and gRPC status codes: the core (worker_svc/core/) sees plain plans and returns plain arrays.
"""

from __future__ import annotations

import argparse
import contextvars
import gc
import logging
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import tls, tracing
from common.auth import worker_token_interceptor
from common.config import MAX_MESSAGE_BYTES, ConfigError, add_arguments, from_namespace
from common.worker_protocol import SERVICE
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from worker_svc.config import WorkerConfig
from worker_svc.core.errors import PlanError, PredecessorRefused
from worker_svc.cpu import binding as cpu_binding
from worker_svc.wire import (
    plan_error_code,
    plan_error_metadata,
    skip_finished_requests,
    step_plan,
    step_result,
    worker_info,
)

if TYPE_CHECKING:  # torch loads only in the worker process, not in `llmserve generate`
    from worker_svc.core.runner import ModelRunner

log = logging.getLogger("llmserve.worker")

SERVICE_NAME = SERVICE
# Machine-readable readiness line on stdout, printed once the server listens (launchers and tests wait for it).
READY_LINE = "LLMSERVE_WORKER_READY port={port} epoch={epoch}"
_READY_RE = re.compile(r"^LLMSERVE_WORKER_READY port=(\d+) epoch=(\S+)$", re.M)


def parse_ready_line(text: str) -> tuple[int, str] | None:
    """(port, epoch) from the first READY_LINE in `text` (one line or a whole log), or None."""
    m = _READY_RE.search(text)
    return (int(m.group(1)), m.group(2)) if m else None


ORDER_WAIT_S = 60.0  # how long a pipelined plan waits for the plan before it (then it is checked as it is)


def call_here(fn: Callable, *args):
    return fn(*args)


class ComputeThread:
    """Runs the worker's torch work on the one thread that loaded the model (the process's main thread in `serve`).

    libgomp keeps a pool of OpenMP threads for each thread that starts parallel regions. Steps run on whichever
    gRPC thread took the call would start a pool per gRPC thread, and once a process holds more OpenMP threads than
    it has cores, libgomp spins only ~100 times at a barrier before it sleeps on a futex: every one of a step's
    ~300 parallel regions then waits for a wake-up (on 2 cores: the second core half idle during the forward).
    One thread for every computation keeps one pool, of exactly the cores."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def call(self, fn: Callable, *args):
        """fn(*args) on the compute thread, from any other thread; its result or its exception here."""
        done: futures.Future = futures.Future()
        self.jobs.put((done, contextvars.copy_context(), fn, args))  # the context: the caller's trace span
        return done.result()

    def run_until(self, stop: Callable[[], bool], poll_s: float = 0.5) -> None:
        """Run the calls as they come until stop() (polled: the main thread must wake for signal handlers)."""
        while not stop():
            try:
                done, ctx, fn, args = self.jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            try:
                done.set_result(ctx.run(fn, *args))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done.set_exception(e)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, compute: Callable = call_here):
        self.runner = runner
        self.compute = compute  # runs the runner's torch work: ComputeThread.call in `serve`, here in tests
        # One step at a time (the batch and KV cache are not shareable), in the order the scheduler planned them.
        self.turn = threading.Condition()
        self.last_handled_step = 0  # the last plan executed or refused
        self.last_refused_step = 0
        self.finished_last_step: set[int] = set()  # slots of the requests the last executed step finished (and forgot)
        self.finished_in_step = 0  # that step's id: only a plan sent right behind it may still name them
        self.last_step_end: float | None = None  # perf_counter when the last step's result was ready

    def Describe(self, request, context):
        with self.turn:
            return worker_info(self.runner)

    def PrepareConstraint(self, request: pb.Constraint, context):
        """Compile on this gRPC thread (not the step's): xgrammar releases the GIL while it compiles."""
        from common.structured_outputs import Constraint, ConstraintError

        try:
            c = Constraint(request.kind, request.spec, request.disable_any_whitespace)
            _, seconds, cached = self.runner.grammars.get(c)
        except ConstraintError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.PrepareConstraintReply(compile_seconds=seconds, cached=cached)

    def LoadLoraAdapter(self, request: pb.LoraAdapterRef, context):
        """Read and check off the step loop (the batch is untouched); the host cache has its own lock."""
        from worker_svc.model.lora import LoraError

        try:
            with self.turn:  # between steps: the pool's host cache is the step's too
                rank = self.compute(self.runner.load_lora, request.name, request.path, request.unload)
        except LoraError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.LoadLoraAdapterReply(rank=rank)

    def ExecuteStep(self, plan: pb.StepPlan, context):
        if tracing.enabled:
            return self._traced_execute(plan, context)
        return self._execute_in_turn(plan, context)

    def _execute_in_turn(self, plan: pb.StepPlan, context) -> pb.StepResult:
        with self.turn:
            if plan.expected_epoch in ("", self.runner.epoch):  # a plan for an earlier process fails at once
                self.turn.wait_for(lambda: plan.after_step_id <= self.last_handled_step, timeout=ORDER_WAIT_S)
            return self._execute(plan, context)

    def _execute(self, plan: pb.StepPlan, context) -> pb.StepResult:
        """Run the plan, and report how long the worker sat without one before it."""
        start = time.perf_counter()
        if plan.after_step_id and plan.after_step_id == self.finished_in_step:
            skip_finished_requests(plan, self.finished_last_step)
        try:
            if plan.after_step_id and plan.after_step_id == self.last_refused_step and not plan.reset_batch:
                # Planned on top of a plan that never ran: its slots may name requests that never joined, or others.
                raise PredecessorRefused(f"the plan it follows (step {plan.after_step_id}) was refused")
            out = self.compute(self.runner.execute, step_plan(plan))
        except PlanError as e:
            self.last_refused_step = plan.step_id
            self._handled(plan)
            context.set_trailing_metadata(plan_error_metadata(e))
            context.abort(plan_error_code(e), str(e))
        self.finished_last_step = set(out.finished_slots.tolist())
        self.finished_in_step = plan.step_id
        self._handled(plan)
        result = step_result(out)
        if self.last_step_end is not None:
            result.idle_seconds = start - self.last_step_end
        self.last_step_end = time.perf_counter()
        return result

    def _handled(self, plan: pb.StepPlan) -> None:
        self.last_handled_step = max(self.last_handled_step, plan.step_id)
        self.turn.notify_all()

    def _traced_execute(self, plan: pb.StepPlan, context):
        """ExecuteStep as a server span continuing the scheduler's trace (W3C context in the metadata)."""
        from opentelemetry import trace

        with tracing.tracer.start_as_current_span(
                f"{SERVICE}/ExecuteStep", context=tracing.extract(context.invocation_metadata()),
                kind=trace.SpanKind.SERVER, attributes={"rpc.system": "grpc", "llmserve.step.id": plan.step_id}):
            return self._execute_in_turn(plan, context)


def execute_step(runner: ModelRunner, plan: pb.StepPlan) -> pb.StepResult:
    """One plan through the runner, wire message in and out (in-process tests and benchmarks)."""
    return step_result(runner.execute(step_plan(plan)))


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, WorkerConfig)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The settings on the command line, validated (SystemExit naming the flag); the bundled model unless --model."""
    from worker_svc.model.loader import default_model_path

    try:
        cfg = from_namespace(WorkerConfig, args)
    except ConfigError as e:
        raise SystemExit(f"worker: {e}") from None
    return replace(cfg, model=cfg.model or default_model_path())


def build_server(runner: ModelRunner, address: str, token: str | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 health_servicer: health.HealthServicer | None = None,
                 compute: Callable = call_here) -> tuple[grpc.Server, int]:
    """`credentials` None serves plaintext; otherwise TLS (mutual TLS when they require client certificates).
    `compute` runs the steps (ComputeThread.call; the default runs them on the gRPC thread)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8), interceptors=[worker_token_interceptor(token)] if token else [],
        options=[("grpc.so_reuseport", 0), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, compute), server)
    health_servicer = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["Worker"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise SystemExit(f"cannot listen on {address}")
    return server, port


def _tls_mode(cfg: WorkerConfig) -> str:
    return "plaintext" if cfg.tls_cert is None else "mutual TLS" if cfg.tls_client_ca else "TLS"


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from common.validation import check_server_tls

    cfg = config_from_args(args)
    try:  # before importing torch and loading the model: a bad TLS flag fails in a second
        check_server_tls(cert=cfg.tls_cert, key=cfg.tls_key, client_ca=cfg.tls_client_ca)
    except ConfigError as e:
        raise SystemExit(f"worker: {e}") from None
    import torch

    from worker_svc.core.runner import ModelRunner, config_summary, resolve_device
    from worker_svc.model import load_heap
    from worker_svc.parallel import rank_group

    device = resolve_device(cfg.device)
    try:  # a worker group: this host's ranks start here, each joins torch.distributed
        group = rank_group.start_group(cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank, cfg.master_addr,
                                     cfg.master_port, device, cfg.distributed_timeout)
    except ValueError as e:
        raise SystemExit(f"worker: {e}") from None
    cpus = None
    if device.type == "cpu":
        local_rank, local_size = (0, 1) if group is None else (group.local_rank, group.local_size)
        try:
            cpus = cpu_binding.rank_cpus(cfg.cpu_omp_threads_bind, cpu_binding.allowed_cpus(), torch.get_num_threads(),
                                         local_rank, local_size)
        except ValueError as e:
            if group is None:
                raise SystemExit(f"worker: {e}") from None
            group.fail(f"worker: {e}")
        if cpus:
            torch.set_num_threads(len(cpus))  # one thread per core, from the model's warm-up on
    if group is None or group.rank == 0:
        tracing.setup("llmserve-worker", cfg.otlp_traces_endpoint)
    try:
        with load_heap.bounded_heap():  # the load's freed buffers go back to the system (load_heap.py)
            runner = ModelRunner(cfg, group)
    except ValueError as e:  # e.g. a --tensor-parallel-size that does not divide the heads
        if group is None:
            raise
        group.fail(f"worker: {e}")
    # What start-up allocated (the model, torch's and gRPC's modules) lives as long as the process: frozen out of the
    # collector's generations, the full collections that the steps' garbage sets off do not walk it again (they took
    # 1-6% of a loaded worker's CPU).
    gc.collect()
    gc.freeze()
    if group is not None and group.rank != 0:
        if cpus:
            log.info("rank %d: %s", group.rank, cpu_binding.bind(cpus))
        rank_group.run_follower(runner)  # no gRPC: rank 0 sends the steps
        return
    if cfg.max_model_len is not None and not cfg.allow_kv_pool_below_max_model_len:
        from common.validation import check_pool

        try:
            check_pool(max_model_len=runner.max_model_len, num_blocks=runner.num_blocks, block_size=runner.block_size)
        except ConfigError as e:
            raise SystemExit(f"worker: {e}") from None
    credentials = tls.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    health_servicer = health.HealthServicer()
    compute = ComputeThread()  # this thread loaded the model; it runs every step
    server, port = build_server(runner, f"{cfg.host}:{cfg.port}", cfg.worker_token, credentials, health_servicer,
                                compute.call)
    if group is not None:  # a dead or stuck rank ends the group: NOT_SERVING, then a non-zero exit
        group.before_exit.append(lambda: [health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                                          for name in ("", SERVICE_NAME)])
        group.start_heartbeat(group.fail)
    server.start()
    if cpus:  # after gRPC's threads started: they keep every core
        log.info("%s", cpu_binding.bind(cpus))
    info = worker_info(runner)
    log.info("worker ready on %s:%d (%s) — %s, %s on %s, %d KV blocks of %d, epoch %s", cfg.host, port,
             _tls_mode(cfg), config_summary(runner.config), info.dtype, info.device, info.num_blocks,
             info.block_size, info.epoch)
    print(READY_LINE.format(port=port, epoch=info.epoch), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    compute.run_until(stop.is_set)
    # Let the step in flight finish (on this thread), then go.
    stopped = server.stop(grace=5)
    compute.run_until(stopped.is_set, poll_s=0.05)
    if group is not None:
        group.stop_others()
        for proc in group.local_procs:
            proc.wait(timeout=30)
    tracing.shutdown()
