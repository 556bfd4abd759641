"""The load generator: an asyncio gRPC client that sends each RequestSpec at its arrival time on its own stream.

Greedy (temperature 0), `ignore_eos` and a fixed `max_tokens`, so every run of a workload produces the same
number of tokens. Each message's tokens get the message's receive time. Request ids and the prefix-cache salt
carry a per-run tag: a server reused across runs (a sweep) neither re-attaches to an old request of the same
name nor serves a later run's prompts from an earlier run's cached blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid

import grpc
from tqdm import tqdm

from llmserve.bench.common import RequestResult, RequestSpec
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc

WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 16, 4
CONNECT_TIMEOUT_S = 30.0
REATTACH_S = 60.0  # how long a request keeps re-attaching while the server answers UNAVAILABLE


def build_request(spec: RequestSpec, tag: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(request_id=f"{tag}-{spec.request_id}", sampling=sampling, cache_salt=tag)
    req.token_ids.ids.extend(spec.prompt_ids)
    return req


async def _send(stub: pb_grpc.LLMServeStub, spec: RequestSpec, tag: str, t0: float, metadata,
                limit: asyncio.Semaphore | None, reattaches: list[int]) -> RequestResult:
    delay = spec.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    r = RequestResult(spec.request_id, len(spec.prompt_ids), spec.arrival_s)
    req = build_request(spec, tag)
    async with limit if limit is not None else contextlib.nullcontext():
        r.sent_s = time.perf_counter() - t0
        deadline = None
        while True:
            req.resume_from_token = r.output_tokens
            call = stub.Generate(req, metadata=metadata)
            finish = ""
            try:
                async for msg in call:
                    now = time.perf_counter() - t0
                    r.output_ids.extend(msg.token_ids)
                    r.token_times.extend([now] * len(msg.token_ids))
                    finish = msg.finish_reason
                    if spec.cancel_after_tokens is not None and r.output_tokens >= spec.cancel_after_tokens \
                            and not finish:
                        call.cancel()  # the server sees the stream go away and aborts the request
                        r.cancelled = True
                        break
                r.ok = r.cancelled or bool(finish)
                if not r.ok:
                    r.error = "stream ended without a finish_reason"
            except grpc.aio.AioRpcError as e:
                # UNAVAILABLE: the scheduler restarted or lost its lease; re-attach by request id from the tokens
                # we have, as `llmserve generate` does, for up to REATTACH_S.
                deadline = deadline or time.monotonic() + REATTACH_S
                if e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    reattaches[0] += 1
                    await asyncio.sleep(0.2)
                    continue
                r.error = f"{e.code().name}: {e.details()}"
            break
        r.end_s = time.perf_counter() - t0
    return r


async def run(target: str, specs: list[RequestSpec], *, max_concurrency: int | None = None,
              api_key: str | None = None, tag: str | None = None,
              progress: bool = True) -> tuple[list[RequestResult], int]:
    """Send every spec at its arrival time (seconds from now). Returns the results in spec order (times from
    now) and how many times a stream had to re-attach after UNAVAILABLE."""
    tag = tag or uuid.uuid4().hex[:8]
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    reattaches = [0]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.LLMServeStub(channel)
        try:
            await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ConnectionError(f"cannot reach {target} within {CONNECT_TIMEOUT_S:g} s") from None
        bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress, file=sys.stderr)
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            r = await _send(stub, spec, tag, t0, metadata, limit, reattaches)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(s) for s in specs))
        bar.close()
    return list(results), reattaches[0]


async def warm_up(target: str, n: int, api_key: str | None = None) -> None:
    """A few short requests before the timed run (first-step costs, tokenizer load); raises if any fails."""
    if n <= 0:
        return
    specs = [RequestSpec(f"warmup-{i}", tuple(range(1000 + i, 1000 + i + WARMUP_PROMPT_TOKENS)), WARMUP_OUTPUT_TOKENS,
                         0.0) for i in range(n)]
    results, _ = await run(target, specs, api_key=api_key, tag=f"warmup-{uuid.uuid4().hex[:8]}", progress=False)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up requests to {target} failed: {failed[0]}")
