"""The public gRPC API (llmserve.v1): GetModelInfo, Generate (streaming), Embed, Abort, the LoRA calls, on grpc.aio.

Admission runs in the event loop's thread pool (scheduler_svc/driver/admission.py); each admitted sequence is
streamed out by a SequenceStream (scheduler_svc/servers/sequence_stream.py) as the outbox rings it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable

import grpc

from common import tracing
from common.public_protocol import ACCEPTED_HEADER
from common.structured_outputs import Constraint
from common.tokenizer import Tokenizer, load_tokenizer
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.core.request import FINISH_STOP
from scheduler_svc.core.scheduler import FINISH_REJECTED, FINISH_TIMEOUT
from scheduler_svc.driver import embed
from scheduler_svc.driver.admission import (
    AdmissionError,
    Limits,
    abort_sequences,
    build_requests,
    check_sampling,
    constraint_of,
    prompt_ids,
    sequence_ids,
)
from scheduler_svc.driver.driver import Driver
from scheduler_svc.driver.frontend import SubmitError
from scheduler_svc.driver.outbox import UNAVAILABLE
from scheduler_svc.driver.worker_client import WorkerError
from scheduler_svc.lora_registry import LoraService
from scheduler_svc.servers.sequence_stream import SequenceStream
from scheduler_svc.servers.store_errors import retryable_store_errors

SERVICE_NAME = "llmserve.v1.LLMServe"


class HandedOver(Exception):
    """This scheduler stopped serving a request it had admitted (a lost lease, Redis failing over): the request
    lives on in Redis and is resumed by whoever leads the pool next."""


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

    @retryable_store_errors
    async def LoadLoraAdapter(self, request, context):
        return await self._lora_call(context, "load", request.lora_name, request.lora_path)

    @retryable_store_errors
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

    @retryable_store_errors
    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        await self.refuse_unless_leading(context)
        return pb.AbortResponse(found=abort_sequences(self.driver.abort, request.request_id))

    @retryable_store_errors
    async def Embed(self, request: pb.EmbedRequest, context):
        if request.WhichOneof("prompt") is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        _, streams = await self.admit(embed.generate_request(request, request.request_id or uuid.uuid4().hex),
                                      context, embed=True)
        # As in Generate: from here a lost lease means "send it again", not "this server cannot take it".
        await context.send_initial_metadata(((ACCEPTED_HEADER, "1"),))
        return await embed.wait(self.driver, streams[0].pub, context)

    async def refuse_unless_leading(self, context) -> None:
        """UNAVAILABLE from a scheduler that does not lead now (a standby, or standing by while Redis fails over):
        it holds none of the pool's requests, so an abort it answered "not found" would be lost."""
        if not self.driver.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler does not lead the pool right now "
                                "(a standby, or Redis is failing over); retry shortly")

    def _admit(self, request: pb.GenerateRequest, metadata, embed: bool = False) -> tuple[str, list[SequenceStream]]:
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
        streams = [SequenceStream(tokenizer, p, i, request.resume_from_token) for i, p in enumerate(pubs)]
        return request.request_id or pubs[0].request.request_id, streams

    def _prepare(self, name: str, c: Constraint) -> None:
        """Have the worker compile the request's grammar now (off its step loop), or refuse the request."""
        try:
            reply = self.driver.worker.prepare_constraint(c.kind, c.spec, c.disable_any_whitespace)
        except WorkerError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise AdmissionError(e.code, f"sampling.{name}: {e}") from None
            raise AdmissionError(grpc.StatusCode.UNAVAILABLE, f"the worker could not prepare sampling.{name} "
                                 f"({e.code.name}: {e}); retry shortly") from None
        self.driver.metrics.grammar_prepared(reply.compile_seconds, reply.cached)

    async def admit(self, request: pb.GenerateRequest, context, rename: Callable[[str], str] = str,
                    embed: bool = False) -> tuple[str, list[SequenceStream]]:
        """Admit `request` off the loop, or end the call with the refusal (`rename` spells its field names the
        caller's way: the vLLM engine protocol names them differently)."""
        driver = self.driver
        if not driver.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet "
                                "(or it is a standby, or draining); retry shortly")
        try:
            return await self.admit_or_raise(request, context, embed)
        except (AdmissionError, SubmitError) as e:
            await context.abort(*refusal_status(e, rename))

    async def admit_or_raise(self, request: pb.GenerateRequest, context,
                             embed: bool = False) -> tuple[str, list[SequenceStream]]:
        """Admit `request` off the loop; a refusal is raised (AdmissionError, SubmitError), not answered."""
        admitted = asyncio.get_running_loop().run_in_executor(None, self._admit, request,
                                                              context.invocation_metadata(), embed)
        try:
            return await asyncio.shield(admitted)
        except asyncio.CancelledError:  # the client left while its request was being admitted
            admitted.add_done_callback(_abort_when_admitted(self.driver))
            raise

    @retryable_store_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        rid, streams = await self.admit(request, context)
        # Queued requests may wait long for a token: say now that we hold this one, so that a lost lease or a
        # restart meanwhile makes the client re-attach instead of failing it (common/public_protocol.py).
        await context.send_initial_metadata(((ACCEPTED_HEADER, "1"),))
        try:
            async for msg in self.stream(rid, streams, context):
                yield msg
        except HandedOver as e:  # the client re-attaches by request id (common/client.py)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def stream(self, rid: str, streams: list[SequenceStream], context):
        """Stream every sequence of a request (index i for sequence i) until all have finished; HandedOver when
        this scheduler stops serving it (a lost lease, Redis failing over) while it lives on in Redis."""
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
                    if finish == UNAVAILABLE:
                        ended = True
                        raise HandedOver(f"this scheduler lost its lease; re-attach with request_id={rid!r} and "
                                         f"resume_from_token={stream.sent}")
                    if finish in (FINISH_TIMEOUT, FINISH_REJECTED):
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


def refusal_status(e: AdmissionError | SubmitError,
                   rename: Callable[[str], str] = str) -> tuple[grpc.StatusCode, str]:
    """The status and message that answer a refused admission."""
    if isinstance(e, AdmissionError):
        return e.code, rename(str(e))
    return grpc.StatusCode[e.code], str(e)


def _error_status(driver: Driver, rid: str, stream: SequenceStream, finish: str) -> tuple[grpc.StatusCode, str]:
    """The status that ends a stream whose request ended without a result (timed out in the queue, refused)."""
    if finish == FINISH_TIMEOUT:
        return (grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} waited longer than --queue-timeout "
                f"{driver.cfg.queue_timeout:g}s before being scheduled")
    return (grpc.StatusCode.INVALID_ARGUMENT, f"request {stream.pub.request.request_id} was refused by the "
            f"worker: {stream.pub.error}")
