"""The public gRPC API (llmserve.v1): Generate (streaming), Abort, GetModelInfo, health, reflection, on grpc.aio."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import tls, tracing
from common.auth import api_key_interceptor
from common.config import MAX_MESSAGE_BYTES, ConfigError, add_arguments, from_namespace
from common.redis_url import probe_redis, redact_url
from common.structured_outputs import Constraint
from common.tokenizer import Tokenizer, load_tokenizer
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2_grpc as vpb_grpc
from scheduler_svc import embed, redis_ha
from scheduler_svc.admission import (
    AdmissionError,
    Limits,
    abort_sequences,
    build_requests,
    check_sampling,
    constraint_of,
    prompt_ids,
    sequence_ids,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import FINISH_REJECTED, FINISH_TIMEOUT
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.driver import Driver, DriverConfig
from scheduler_svc.frontend import SubmitError
from scheduler_svc.lora_registry import LoraService, lora_service
from scheduler_svc.metrics import Metrics
from scheduler_svc.outbox import UNAVAILABLE, Published
from scheduler_svc.policy import PolicyConfig
from scheduler_svc.request import FINISH_STOP
from scheduler_svc.store import RedisLedger
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.vllm_engine import VllmEngineServicer
from scheduler_svc.worker_client import WorkerError

log = logging.getLogger("llmserve.scheduler")

SERVICE_NAME = "llmserve.v1.LLMServe"
# Machine-readable line on stdout once the gRPC server listens (not yet SERVING: that needs the worker and the lease).
LISTENING_LINE = "LLMSERVE_SCHEDULER_LISTENING port={port}"
_LISTENING_RE = re.compile(r"^LLMSERVE_SCHEDULER_LISTENING port=(\d+)$", re.M)


def parse_listening_line(text: str) -> int | None:
    """The port from the first LISTENING_LINE in `text` (one line or a whole log), or None."""
    m = _LISTENING_RE.search(text)
    return int(m.group(1)) if m else None


class LLMServeServicer(pb_grpc.LLMServeServicer):
    """The public API on one asyncio event loop (grpc.aio). Streams sleep until the outbox rings them: a committed
    step wakes only the streams whose requests got tokens or finished. Admission (tokenizing, Redis look-ups,
    loading the tokenizer) runs in the loop's thread pool so that it never stalls the streams."""

    def __init__(self, driver: Driver, tokenizer_path: str | None = None, loras: LoraService | None = None):
        self.driver = driver
        self.loras = loras  # None: no LoRA adapters (a request naming one gets NOT_FOUND)
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_path = tokenizer_path
        self._tok_lock = threading.Lock()

    def tokenizer(self) -> Tokenizer:
        with self._tok_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._tokenizer_path or self.driver.worker_info.model.path)
            return self._tokenizer

    def limits(self) -> Limits:
        info = self.driver.worker_info
        return Limits(max_model_len=info.max_model_len, vocab_size=info.model.vocab_size,
                      kv_pool_tokens=info.num_blocks * info.block_size, block_size=info.block_size)

    async def GetModelInfo(self, request, context):
        info = self.driver.worker_info
        if info is None or not self.driver.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet")
        pol = self.driver.cfg.policy
        return pb.ModelInfoResponse(
            model_name=info.model.name, model_path=info.model.path, max_model_len=info.max_model_len,
            vocab_size=info.model.vocab_size, block_size=info.block_size, num_blocks=info.num_blocks,
            dtype=info.dtype, device=info.device, worker_epoch=info.epoch, max_num_seqs=pol.max_num_seqs,
            max_num_batched_tokens=pol.max_num_batched_tokens,
            lora_adapters=[pb.LoraAdapter(name=n, path=p)
                           for n, p in (self.loras.adapters() if self.loras else {}).items()])

    async def LoadLoraAdapter(self, request, context):
        return await self._lora_call(context, "load", request.lora_name, request.lora_path)

    async def UnloadLoraAdapter(self, request, context):
        return await self._lora_call(context, "unload", request.lora_name)

    async def _lora_call(self, context, op: str, *args):
        if self.loras is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler serves no LoRA adapters")
        try:
            message = await asyncio.get_running_loop().run_in_executor(None, getattr(self.loras, op), *args)
        except AdmissionError as e:
            await context.abort(e.code, str(e))
        return pb.LoadLoraAdapterResponse(message=message)

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return pb.AbortResponse(found=abort_sequences(self.driver.abort, request.request_id))

    async def Embed(self, request: pb.EmbedRequest, context):
        if request.WhichOneof("prompt") is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        _, streams = await self.admit(embed.generate_request(request, request.request_id or uuid.uuid4().hex),
                                      context, embed=True)
        return await embed.wait(self.driver, streams[0].pub, context)

    def _admit(self, request: pb.GenerateRequest, metadata, embed: bool = False) -> tuple[str, list[_SequenceStream]]:
        """In the thread pool: find the request (memory, then Redis) or validate, tokenize and submit it."""
        driver = self.driver
        check_sampling(request.sampling)
        structured = constraint_of(request.sampling)
        seq_ids = sequence_ids(request.request_id, request.sampling.n) if request.request_id else []
        pubs = [p for rid in seq_ids if (p := driver.lookup(rid)) is not None]
        if not pubs:
            limits = self.limits()
            tokenizer = self.tokenizer()
            lora_path = ""
            if request.lora_name:
                if self.loras is None:
                    raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"lora_name {request.lora_name!r}: this "
                                         "scheduler serves no LoRA adapters (--enable-lora)")
                lora_path = self.loras.path_for(request.lora_name)
            ids = prompt_ids(request, tokenizer, limits)
            reqs = build_requests(request, ids, limits, request.request_id or uuid.uuid4().hex, tokenizer,
                                  lora_path)
            reqs[0].sampling.embed = embed
            if structured is not None:  # the request waits here, not in a batch slot, while its grammar compiles
                self._prepare(*structured)
            if tracing.enabled:  # join the caller's trace (W3C traceparent metadata); never stored in Redis
                parent = tracing.extract(metadata)
                for req in reqs:
                    req.trace_context = parent
            pubs = driver.submit(reqs)
        tokenizer = self.tokenizer()
        streams = [_SequenceStream(tokenizer, p, i, request.resume_from_token) for i, p in enumerate(pubs)]
        return request.request_id or pubs[0].request.request_id, streams

    def _prepare(self, name: str, c: Constraint) -> None:
        """Have the worker compile the request's grammar now (off its step loop), or refuse the request."""
        try:
            reply = self.driver.worker.prepare_constraint(c.kind, c.spec)
        except WorkerError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise AdmissionError(e.code, f"sampling.{name}: {e}") from None
            raise AdmissionError(grpc.StatusCode.UNAVAILABLE, f"the worker could not prepare sampling.{name} "
                                 f"({e.code.name}: {e}); retry shortly") from None
        self.driver.metrics.grammar_prepared(reply.compile_seconds, reply.cached)

    async def admit(self, request: pb.GenerateRequest, context, rename: Callable[[str], str] = str,
                    embed: bool = False) -> tuple[str, list[_SequenceStream]]:
        """Admit `request` off the loop, or end the call with the refusal (`rename` spells its field names the
        caller's way: the vLLM engine protocol names them differently)."""
        driver = self.driver
        if not driver.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet "
                                "(or it is a standby, or draining); retry shortly")
        admitted = asyncio.get_running_loop().run_in_executor(None, self._admit, request,
                                                              context.invocation_metadata(), embed)
        try:
            return await asyncio.shield(admitted)
        except AdmissionError as e:
            await context.abort(e.code, rename(str(e)))
        except SubmitError as e:
            await context.abort(grpc.StatusCode[e.code], str(e))
        except asyncio.CancelledError:  # the client left while its request was being admitted
            admitted.add_done_callback(_abort_when_admitted(driver))
            raise

    async def Generate(self, request: pb.GenerateRequest, context):
        rid, streams = await self.admit(request, context)
        async for msg in self.stream(rid, streams, context):
            yield msg

    async def stream(self, rid: str, streams: list[_SequenceStream], context):
        """Stream every sequence of a request (index i for sequence i) until all have finished."""
        driver, outbox = self.driver, self.driver.outbox
        watch = outbox.watch([s.pub.request.request_id for s in streams])
        live = list(streams)
        ended = False  # finished (or handed over): a client leaving now aborts nothing
        try:
            while live:
                with driver.lock:
                    news = [(s, *s.take()) for s in live if s.has_news()]
                if not news:
                    await watch.wait()
                    continue
                for stream, new, lps, finish in news:
                    msg, finish = stream.advance(rid, new, lps, finish)
                    if stream.stopped_by_string:
                        driver.abort(stream.pub.request.request_id, FINISH_STOP)
                    if finish is None:
                        if msg.token_ids or msg.text:
                            yield msg
                        continue
                    live.remove(stream)
                    if finish in (FINISH_TIMEOUT, FINISH_REJECTED, UNAVAILABLE):
                        ended = True
                        await context.abort(*_error_status(driver, rid, stream, finish))
                    yield msg
            ended = True
        finally:
            outbox.unwatch(watch)
            if not ended:  # the client went away mid-stream: free its KV at the next iteration boundary
                for s in streams:
                    driver.abort(s.pub.request.request_id)


def _abort_when_admitted(driver: Driver):
    def abort(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for s in fut.result()[1]:
                driver.abort(s.pub.request.request_id)
    return abort


def _error_status(driver: Driver, rid: str, stream: _SequenceStream, finish: str) -> tuple[grpc.StatusCode, str]:
    """The status that ends a stream whose request ended without a result."""
    if finish == FINISH_TIMEOUT:
        return (grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} waited longer than --queue-timeout "
                f"{driver.cfg.queue_timeout:g}s before being scheduled")
    if finish == FINISH_REJECTED:
        return (grpc.StatusCode.INVALID_ARGUMENT, f"request {stream.pub.request.request_id} was refused by the "
                f"worker: {stream.pub.error}")
    return (grpc.StatusCode.UNAVAILABLE, "this scheduler lost its lease; re-attach with "
            f"request_id={rid!r} and resume_from_token={stream.sent}")


class _SequenceStream:
    """One sequence's way out: committed tokens -> text deltas, stop strings, the final message."""

    def __init__(self, tokenizer: Tokenizer, pub: Published, index: int, resume_from: int):
        req = pub.request
        self.pub = pub
        self.index = index
        self.resume_from = resume_from
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, req.skip_special_tokens, req.stop,
                                            req.include_stop_str_in_output)
        self.sent = 0  # tokens consumed from pub.token_ids
        self.stopped_by_string = False

    def has_news(self) -> bool:  # called under the driver lock
        if self.sent == 0 and self.resume_from == 0 and self.pub.awaits_prompt_logprobs:
            return False  # the first message carries them: a recovered request's tokens wait for its recompute
        return len(self.pub.token_ids) > self.sent or self.pub.finish_reason is not None

    def take(self):  # called under the driver lock
        return self.pub.token_ids[self.sent :], self.pub.logprobs[self.sent :], self.pub.finish_reason

    def advance(self, rid: str, new: list[int], lps: list, finish: str | None):
        """Turn new tokens into one message; returns it and the finish reason (None while running)."""
        msg = pb.GenerateResponse(request_id=rid, index=self.index, first_token_index=max(self.sent, self.resume_from))
        if self.sent == 0 and self.resume_from == 0 and self.pub.prompt_logprobs is not None:
            add_prompt_logprobs(msg, self.pub.request.prompt_ids, self.pub.prompt_logprobs)
        for i, tok in enumerate(new):
            delta = self.detok.push([tok])
            index = self.sent + i
            if index >= self.resume_from:
                msg.token_ids.append(tok)
                msg.text += delta
                lp = lps[i] if i < len(lps) else None
                if lp is not None:
                    msg.logprobs.add(token_id=tok, logprob=lp.logprob,
                                     top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
            if self.detok.stopped_by is not None:
                self.sent = index + 1
                self.stopped_by_string = True
                finish = FINISH_STOP
                break
        else:
            self.sent += len(new)
        if finish is not None:
            if not self.stopped_by_string:
                msg.text += self.detok.flush()
            msg.finish_reason = finish
            msg.usage.prompt_tokens = self.pub.request.num_prompt_tokens
            msg.usage.completion_tokens = self.sent
        return msg, finish


def add_prompt_logprobs(msg: pb.GenerateResponse, prompt_ids: list[int], lps: list) -> None:
    """The prompt's token ids and, from its second token on, each one's logprob and top ones."""
    msg.prompt_token_ids.extend(prompt_ids)
    for tok, lp in zip(prompt_ids[1:], lps[1:], strict=True):
        msg.prompt_logprobs.add(token_id=tok, logprob=lp.logprob,
                                top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])


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
                        lease_ttl_ms=cfg.lease_ttl_ms, debug_invariants=cfg.debug_invariants,
                        worker_token=cfg.worker_token, step_log=cfg.step_log,
                        worker_credentials=worker_credentials, worker_server_name=cfg.worker_tls_server_name)
    return Driver(dcfg, ledger, Metrics()), ledger


class PublicServer:
    """The grpc.aio server of the public API and the event loop it runs on, in a thread of its own ("grpc-aio"), so
    that `llmserve scheduler` and the in-process stacks of the tests drive it the same way: start(), stop(grace)."""

    def __init__(self, driver: Driver, address: str, api_key: str | None, tokenizer_path: str | None,
                 credentials: grpc.ServerCredentials | None, loras: LoraService | None = None):
        self.driver = driver
        self.loras = loras
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self.thread.start()
        try:
            self.port = self._run(self._build(address, api_key, tokenizer_path, credentials))
        except BaseException:
            self._close_loop()
            raise
        if self.port == 0:
            self._close_loop()
            raise SystemExit(f"cannot listen on {address}")
        driver.outbox.attach(self.loop)
        self._health_lock = threading.Lock()  # health reports in the order of the readiness changes
        self._serving = False
        driver.on_ready_change = self._on_ready

    async def _build(self, address: str, api_key: str | None, tokenizer_path: str | None,
                     credentials: grpc.ServerCredentials | None) -> int:
        interceptors = [api_key_interceptor(api_key)] if api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.servicer = LLMServeServicer(self.driver, tokenizer_path, self.loras)
        pb_grpc.add_LLMServeServicer_to_server(self.servicer, self.server)
        # vLLM's engine protocol on the same port: what the smg gateway routes to (`--backend vllm`)
        self.vllm_servicer = VllmEngineServicer(self.servicer)
        vpb_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, VLLM_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        try:
            return (self.server.add_insecure_port(address) if credentials is None
                    else self.server.add_secure_port(address, credentials))
        except RuntimeError:  # the address is taken or invalid
            return 0

    def _run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _on_ready(self, ready: bool) -> None:
        """From the driver thread: health follows the driver's readiness, SERVING once the tokenizer is loaded too
        (1-2 s for a GGUF's vocabulary, which a first request arriving at SERVING used to wait for)."""
        with self._health_lock:
            self._serving = ready
            if ready:
                threading.Thread(target=self._serve_with_tokenizer, name="load-tokenizer", daemon=True).start()
            else:
                self._report(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _serve_with_tokenizer(self) -> None:
        try:
            self.servicer.tokenizer()
        except Exception as e:  # noqa: BLE001  (requests will name the error; health still follows the worker)
            log.warning("cannot load the tokenizer: %s", e)
        with self._health_lock:  # not if the worker went away or a drain began meanwhile
            if self._serving:
                self._report(health_pb2.HealthCheckResponse.SERVING)

    def _report(self, status) -> None:
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._set_health(status), self.loop)

    def start(self) -> None:
        self._run(self.server.start())

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let those in progress end for up to `grace` seconds (then cancel them), close."""
        if self.loop.is_closed():
            return
        try:
            self._run(self.server.stop(grace))
        finally:
            self.driver.outbox.attach(None)
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def build_server(driver: Driver, address: str, api_key: str | None = None, tokenizer_path: str | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 loras: LoraService | None = None) -> tuple[PublicServer, int, object]:
    """The public API server (not started), its port and its health servicer. `credentials` None serves plaintext;
    otherwise TLS (mutual TLS when they require client certificates)."""
    server = PublicServer(driver, address, api_key, tokenizer_path, credentials, loras)
    return server, server.port, server.health


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

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Scheduler:
        cfg = self.cfg
        self.server, self.port, self.health = build_server(
            self.driver, f"{cfg.host}:{cfg.port}", cfg.api_key, cfg.tokenizer,
            tls.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca), self.loras)
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
