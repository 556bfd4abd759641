"""The public gRPC API (llmserve.v1): Generate (streaming), Abort, GetModelInfo, health, reflection, on grpc.aio."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import re
import signal
import threading
import urllib.parse
import uuid
from collections.abc import Callable

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import tls, tracing
from common.auth import add_worker_token_arg, api_key_interceptor
from common.structured_outputs import Constraint
from common.validation import ConfigError, check_channel_tls, check_limits, check_server_tls
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2_grpc as vpb_grpc
from scheduler_svc.admission import (
    AdmissionError,
    Limits,
    build_requests,
    check_sampling,
    constraint_of,
    prompt_ids,
    sequence_ids,
)
from scheduler_svc.core import FINISH_REJECTED, FINISH_TIMEOUT
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.driver import Driver, DriverConfig
from scheduler_svc.frontend import SubmitError
from scheduler_svc.metrics import Metrics
from scheduler_svc.outbox import UNAVAILABLE, Published
from scheduler_svc.policy import SCHEDULING_MODES, PolicyConfig
from scheduler_svc.request import FINISH_STOP
from scheduler_svc.speculative import SpeculativeConfig, parse_speculative_config
from scheduler_svc.store import RedisLedger
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.vllm_engine import VllmEngineServicer
from scheduler_svc.worker_client import WorkerError

log = logging.getLogger("llmserve.scheduler")

SERVICE_NAME = "llmserve.v1.LLMServe"
MAX_MESSAGE_BYTES = 64 << 20
# Machine-readable line on stdout once the gRPC server listens (not yet SERVING: that needs the worker and the lease).
LISTENING_LINE = "LLMSERVE_SCHEDULER_LISTENING port={port}"
_LISTENING_RE = re.compile(r"^LLMSERVE_SCHEDULER_LISTENING port=(\d+)$", re.M)


def parse_listening_line(text: str) -> int | None:
    """The port from the first LISTENING_LINE in `text` (one line or a whole log), or None."""
    m = _LISTENING_RE.search(text)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=4)
def _tokenizer_for(model_path: str) -> Tokenizer:
    if model_path.endswith(".gguf"):
        return Tokenizer.from_gguf(model_path)
    return Tokenizer.from_hf_dir(model_path)


class LLMServeServicer(pb_grpc.LLMServeServicer):
    """The public API on one asyncio event loop (grpc.aio). Streams sleep until the outbox rings them: a committed
    step wakes only the streams whose requests got tokens or finished. Admission (tokenizing, Redis look-ups,
    loading the tokenizer) runs in the loop's thread pool so that it never stalls the streams."""

    def __init__(self, engine: Driver, tokenizer_path: str | None = None):
        self.engine = engine
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_path = tokenizer_path
        self._tok_lock = threading.Lock()

    def tokenizer(self) -> Tokenizer:
        with self._tok_lock:
            if self._tokenizer is None:
                self._tokenizer = _tokenizer_for(self._tokenizer_path or self.engine.worker_info.model.path)
            return self._tokenizer

    def limits(self) -> Limits:
        info = self.engine.worker_info
        return Limits(max_model_len=info.max_model_len, vocab_size=info.model.vocab_size,
                      kv_pool_tokens=info.num_blocks * info.block_size, block_size=info.block_size)

    async def GetModelInfo(self, request, context):
        info = self.engine.worker_info
        if info is None or not self.engine.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet")
        pol = self.engine.cfg.policy
        return pb.ModelInfoResponse(
            model_name=info.model.name, model_path=info.model.path, max_model_len=info.max_model_len,
            vocab_size=info.model.vocab_size, block_size=info.block_size, num_blocks=info.num_blocks,
            dtype=info.dtype, device=info.device, worker_epoch=info.epoch, max_num_seqs=pol.max_num_seqs,
            max_num_batched_tokens=pol.max_num_batched_tokens)

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    def _admit(self, request: pb.GenerateRequest, metadata) -> tuple[str, list[_SequenceStream]]:
        """In the thread pool: find the request (memory, then Redis) or validate, tokenize and submit it."""
        engine = self.engine
        check_sampling(request.sampling)
        structured = constraint_of(request.sampling)
        seq_ids = sequence_ids(request.request_id, request.sampling.n) if request.request_id else []
        pubs = [p for rid in seq_ids if (p := engine.lookup(rid)) is not None]
        if not pubs:
            limits = self.limits()
            tokenizer = self.tokenizer()
            ids = prompt_ids(request, tokenizer, limits)
            reqs = build_requests(request, ids, limits, request.request_id or uuid.uuid4().hex, tokenizer)
            if structured is not None:  # the request waits here, not in a batch slot, while its grammar compiles
                self._prepare(*structured)
            if tracing.enabled:  # join the caller's trace (W3C traceparent metadata); never stored in Redis
                parent = tracing.extract(metadata)
                for req in reqs:
                    req.trace_context = parent
            pubs = engine.submit(reqs)
        tokenizer = self.tokenizer()
        streams = [_SequenceStream(tokenizer, p, i, request.resume_from_token) for i, p in enumerate(pubs)]
        return request.request_id or pubs[0].request.request_id, streams

    def _prepare(self, name: str, c: Constraint) -> None:
        """Have the worker compile the request's grammar now (off its step loop), or refuse the request."""
        try:
            reply = self.engine.worker.prepare_constraint(c.kind, c.spec)
        except WorkerError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise AdmissionError(e.code, f"sampling.{name}: {e}") from None
            raise AdmissionError(grpc.StatusCode.UNAVAILABLE, f"the worker could not prepare sampling.{name} "
                                 f"({e.code.name}: {e}); retry shortly") from None
        self.engine.metrics.grammar_prepared(reply.compile_seconds, reply.cached)

    async def admit(self, request: pb.GenerateRequest, context,
                    rename: Callable[[str], str] = str) -> tuple[str, list[_SequenceStream]]:
        """Admit `request` off the loop, or end the call with the refusal (`rename` spells its field names the
        caller's way: the vLLM engine protocol names them differently)."""
        engine = self.engine
        if not engine.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet "
                                "(or it is a standby, or draining); retry shortly")
        admitted = asyncio.get_running_loop().run_in_executor(None, self._admit, request,
                                                              context.invocation_metadata())
        try:
            return await asyncio.shield(admitted)
        except AdmissionError as e:
            await context.abort(e.code, rename(str(e)))
        except SubmitError as e:
            await context.abort(grpc.StatusCode[e.code], str(e))
        except asyncio.CancelledError:  # the client left while its request was being admitted
            admitted.add_done_callback(_abort_when_admitted(engine))
            raise

    async def Generate(self, request: pb.GenerateRequest, context):
        rid, streams = await self.admit(request, context)
        async for msg in self.stream(rid, streams, context):
            yield msg

    async def stream(self, rid: str, streams: list[_SequenceStream], context):
        """Stream every sequence of a request (index i for sequence i) until all have finished."""
        engine, outbox = self.engine, self.engine.outbox
        watch = outbox.watch([s.pub.request.request_id for s in streams])
        live = list(streams)
        ended = False  # finished (or handed over): a client leaving now aborts nothing
        try:
            while live:
                with engine.lock:
                    news = [(s, *s.take()) for s in live if s.has_news()]
                if not news:
                    await watch.wait()
                    continue
                for stream, new, lps, finish in news:
                    msg, finish = stream.advance(rid, new, lps, finish)
                    if stream.stopped_by_string:
                        engine.abort(stream.pub.request.request_id, FINISH_STOP)
                    if finish is None:
                        if msg.token_ids or msg.text:
                            yield msg
                        continue
                    live.remove(stream)
                    if finish in (FINISH_TIMEOUT, FINISH_REJECTED, UNAVAILABLE):
                        ended = True
                        await context.abort(*_error_status(engine, rid, stream, finish))
                    yield msg
            ended = True
        finally:
            outbox.unwatch(watch)
            if not ended:  # the client went away mid-stream: free its KV at the next iteration boundary
                for s in streams:
                    engine.abort(s.pub.request.request_id)


def _abort_when_admitted(engine: Driver):
    def abort(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for s in fut.result()[1]:
                engine.abort(s.pub.request.request_id)
    return abort


def _error_status(engine: Driver, rid: str, stream: _SequenceStream, finish: str) -> tuple[grpc.StatusCode, str]:
    """The status that ends a stream whose request ended without a result."""
    if finish == FINISH_TIMEOUT:
        return (grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} waited longer than --queue-timeout "
                f"{engine.cfg.queue_timeout:g}s before being scheduled")
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

    def has_news(self) -> bool:  # called under the engine lock
        return len(self.pub.token_ids) > self.sent or self.pub.finish_reason is not None

    def take(self):  # called under the engine lock
        return self.pub.token_ids[self.sent :], self.pub.logprobs[self.sent :], self.pub.finish_reason

    def advance(self, rid: str, new: list[int], lps: list, finish: str | None):
        """Turn new tokens into one message; returns it and the finish reason (None while running)."""
        msg = pb.GenerateResponse(request_id=rid, index=self.index, first_token_index=max(self.sent, self.resume_from))
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


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--redis-url", default=None, help="Redis holding the scheduling state")
    g.add_argument("--namespace", default="llmserve", help="prefix of every Redis key")
    g.add_argument("--worker-address", default="127.0.0.1:50061")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per iteration (default 512 on CPU, 8192 on GPU)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="running requests cap (default 64 CPU, 256 GPU)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (hash-chained full blocks)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--scheduling-mode", choices=SCHEDULING_MODES, default="continuous",
                   help="continuous: iteration-level admission (the product); static: a new batch only when the "
                   "previous one has finished; naive: one request at a time. The last two exist for benchmarks")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="commit and publish each step while the worker already runs the next one (the next plan is "
                   "built from the previous step's result); --no-async-scheduling commits between the two")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                   "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}' (n-gram prompt lookup; the only method)")
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="append one JSON line per step (scheduled/admitted/preempted/finished ids, queue sizes, "
                   "KV usage): for benchmarks and tests")
    g.add_argument("--max-num-queued-requests", type=int, default=10_000)
    g.add_argument("--queue-timeout", type=float, default=0.0, help="seconds a request may wait; 0 = forever")
    g.add_argument("--api-key", default=None)
    g.add_argument("--metrics-port", type=int, default=None)
    g.add_argument("--lease-ttl-ms", type=int, default=5000)
    g.add_argument("--debug-invariants", action="store_true", help="check the block ledger after every step")
    g.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them; 0 hands them "
                        "over to the next scheduler (they stay in Redis, clients re-attach)")
    g.add_argument("--tokenizer", default=None, help="GGUF or HF directory for the tokenizer (default: the model)")
    tracing.add_otlp_arg(g)
    add_worker_token_arg(g)
    tls.add_server_tls_args(g)
    g.add_argument("--worker-tls-ca", default=None,
                   help="connect to the worker over TLS, trusting this CA bundle (PEM) (default: plaintext)")
    g.add_argument("--worker-tls-cert", default=None,
                   help="client certificate (PEM) for a worker that requires one (its --tls-client-ca)")
    g.add_argument("--worker-tls-key", default=None, help="private key (PEM) of --worker-tls-cert")
    g.add_argument("--worker-tls-server-name", default=None,
                   help="expect this name in the worker's certificate instead of --worker-address's host")


def redact_url(url: str) -> str:
    """`url` with its password (and any *password* query value) replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{k}=***" if "password" in k.lower() else f"{k}={v}"
                     for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def connect_redis(url: str) -> redis.Redis:
    """The scheduler's Redis client, after one PING went through: a wrong password, a TLS mismatch or an unreachable
    server ends the process at start with a message naming --redis-url (password redacted) instead of an engine
    that retries the same failure forever."""
    shown = redact_url(url)
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=10) as probe:
            probe.ping()
    except redis.AuthenticationError as e:
        raise SystemExit(f"--redis-url {shown}: Redis refused the credentials ({e}); put the right password in the "
                         "URL: redis://:PASSWORD@host:port/db") from None
    except redis.ResponseError as e:
        raise SystemExit(f"--redis-url {shown}: Redis answered PING with an error: {e}") from None
    except redis.RedisError as e:
        if isinstance(e.__context__, ConnectionRefusedError):
            hint = "is Redis running there?"
        elif url.startswith("rediss://"):
            hint = ("with rediss:// the port must serve TLS and its certificate must be signed by the CA named by "
                    "?ssl_ca_certs=PATH (or the system's)")
        else:
            hint = "a Redis that serves TLS only drops plaintext connections: use rediss://...?ssl_ca_certs=PATH"
        raise SystemExit(f"--redis-url {shown}: cannot use Redis: {e} ({hint})") from None
    except (OSError, ValueError, TypeError) as e:  # a malformed URL, an unknown query option, an unreadable file
        raise SystemExit(f"--redis-url {shown}: {e}") from None
    # Blocking pool: a burst of Generate calls that look up request ids waits for a connection instead of failing.
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30))


def scheduler_from_args(args: argparse.Namespace) -> tuple[Driver, RedisLedger]:
    if not args.redis_url:
        raise SystemExit("--redis-url is required (or use `llmserve serve`, which starts a private redis-server)")
    for flag in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    # 0 = size for the worker's device once it has described itself (see leadership.take_pool).
    policy = PolicyConfig(max_num_batched_tokens=args.max_num_batched_tokens or 0,
                          max_num_seqs=args.max_num_seqs or 0, block_size=0,
                          enable_chunked_prefill=args.enable_chunked_prefill,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          scheduling_policy=args.scheduling_policy,
                          enable_prefix_caching=args.enable_prefix_caching,
                          scheduling_mode=args.scheduling_mode,
                          speculative=speculative_from_args(args))
    ledger = RedisLedger(connect_redis(args.redis_url), namespace=args.namespace)
    worker_credentials = None
    if args.worker_tls_ca is not None:
        worker_credentials = tls.channel_credentials(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    tokenizer = None  # an explicit --tokenizer must fit the model's vocabulary (checked once the worker answers)
    if args.tokenizer:
        tokenizer = (args.tokenizer, _tokenizer_for(args.tokenizer).vocab_size)
    cfg = DriverConfig(policy=policy, tokenizer=tokenizer, async_scheduling=args.async_scheduling,
                       worker_address=args.worker_address,
                       max_num_queued_requests=args.max_num_queued_requests, queue_timeout=args.queue_timeout,
                       lease_ttl_ms=args.lease_ttl_ms, debug_invariants=args.debug_invariants,
                       worker_token=args.worker_token, step_log=args.step_log,
                       worker_credentials=worker_credentials, worker_server_name=args.worker_tls_server_name)
    return Driver(cfg, ledger, Metrics()), ledger


class PublicServer:
    """The grpc.aio server of the public API and the event loop it runs on, in a thread of its own ("grpc-aio"), so
    that `llmserve scheduler` and the in-process stacks of the tests drive it the same way: start(), stop(grace)."""

    def __init__(self, engine: Driver, address: str, api_key: str | None, tokenizer_path: str | None,
                 credentials: grpc.ServerCredentials | None):
        self.engine = engine
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
        engine.outbox.attach(self.loop)
        engine.on_ready_change = self._on_ready

    async def _build(self, address: str, api_key: str | None, tokenizer_path: str | None,
                     credentials: grpc.ServerCredentials | None) -> int:
        interceptors = [api_key_interceptor(api_key)] if api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.servicer = LLMServeServicer(self.engine, tokenizer_path)
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
        """From the driver thread: health follows the engine's readiness."""
        if ready:
            # Load the tokenizer now rather than on the first request (seconds for a GGUF's vocabulary).
            threading.Thread(target=self.servicer.tokenizer, daemon=True).start()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
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
            self.engine.outbox.attach(None)
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def build_server(engine: Driver, address: str, api_key: str | None = None, tokenizer_path: str | None = None,
                 credentials: grpc.ServerCredentials | None = None) -> tuple[PublicServer, int, object]:
    """The public API server (not started), its port and its health servicer. `credentials` None serves plaintext;
    otherwise TLS (mutual TLS when they require client certificates)."""
    server = PublicServer(engine, address, api_key, tokenizer_path, credentials)
    return server, server.port, server.health


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    try:
        return parse_speculative_config(getattr(args, "speculative_config", None))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def check_flags(args: argparse.Namespace) -> None:
    """Incompatible combinations fail at start-up, naming the flags and the values. The block size and
    max-model-len are checked here when they are flags of this command (`llmserve serve`), otherwise once the
    worker has described itself (leadership.sized_policy)."""
    for flag in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    spec = speculative_from_args(args)
    if spec is not None and args.scheduling_mode != "continuous":
        raise SystemExit(f"--speculative-config needs --scheduling-mode continuous (got {args.scheduling_mode}): the "
                         "static and naive modes are baselines of plain decoding; drop one of them")
    if args.long_prefill_token_threshold and not args.enable_chunked_prefill:
        raise SystemExit("--long-prefill-token-threshold only applies with --enable-chunked-prefill; "
                         "drop one of them")
    try:
        check_limits(block_size=getattr(args, "block_size", None), budget=args.max_num_batched_tokens,
                     max_model_len=getattr(args, "max_model_len", None),
                     chunked=args.enable_chunked_prefill or args.scheduling_mode != "continuous")
        check_server_tls(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)
        check_channel_tls(ca=args.worker_tls_ca, cert=args.worker_tls_cert, key=args.worker_tls_key,
                          server_name=args.worker_tls_server_name)
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_flags(args)
    tracing.setup("llmserve-scheduler", args.otlp_traces_endpoint)
    engine, _ = scheduler_from_args(args)
    server, port, _ = build_server(engine, f"{args.host}:{args.port}", args.api_key, args.tokenizer,
                                   tls.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca))
    if args.metrics_port is not None:
        engine.metrics.serve(args.metrics_port)
    server.start()
    engine.start()
    log.info("scheduler listening on %s:%d (%s; worker %s over %s; redis %s)", args.host, port,
             "plaintext" if args.tls_cert is None else "mutual TLS" if args.tls_client_ca else "TLS",
             args.worker_address, "plaintext" if args.worker_tls_ca is None else "TLS", redact_url(args.redis_url))
    print(LISTENING_LINE.format(port=port), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A timed wait: a signal that lands on another thread sets only a flag, which the main thread acts on when it
    # runs Python code again; an untimed wait could sleep through SIGTERM (seen: a scheduler ignoring it for 12 min).
    while not stop.wait(0.5):
        if engine.fatal:
            break
    shutdown(engine, server, args.shutdown_timeout)
    tracing.shutdown()
    if engine.fatal:
        raise SystemExit(f"scheduler: {engine.fatal}")


def shutdown(engine: Driver, server: PublicServer, timeout: float) -> None:
    """Graceful drain: NOT_SERVING and no admission at once, in-flight requests finish (up to `timeout`), the rest
    are aborted; with timeout 0 they are left in Redis for the next leader (streams end UNAVAILABLE)."""
    log.info("draining (shutdown timeout %gs)", timeout)
    aborted = engine.drain(timeout)
    if aborted:
        log.warning("aborted %d requests still running after --shutdown-timeout %gs", aborted, timeout)
    engine.stop()
    server.stop(grace=2)
