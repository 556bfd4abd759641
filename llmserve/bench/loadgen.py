"""The load generator: sends each RequestSpec at its arrival time on its own stream, through one of two transports.

- GrpcTransport: llmserve.v1 Generate through common.client (which re-attaches by request id after UNAVAILABLE).
- HttpTransport: the OpenAI-compatible API, a streamed /v1/completions per request (token-id prompt, greedy,
  `ignore_eos`, a fixed `max_tokens`, `stream_options.include_usage`) as `vllm bench serve` sends it, plus vLLM's
  `return_token_ids` so that every chunk's tokens are known.

Arrival timing, the concurrency cap, cancellation, warm-up and the per-token receive times are written once here:
each message's (chunk's) tokens get the time it arrived. Requests are greedy with `ignore_eos` and a fixed
`max_tokens`, so every run of a workload produces the same number of tokens. Request ids and the prefix-cache salt
carry a per-run tag: a server reused across runs (a sweep) neither re-attaches to an old request of the same name
nor serves a later run's prompts from an earlier run's cached blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
import httpx
from tqdm import tqdm

from common.client import Client, IncompleteStream
from llmserve.bench.common import RequestResult, RequestSpec
from protos import llmserve_pb2 as pb

WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 16, 4
CONNECT_TIMEOUT_S = 30.0
REATTACH_S = 60.0  # how long a gRPC request keeps re-attaching while the server answers UNAVAILABLE

PromptText = Callable[[tuple[int, ...]], str]
Tokens = tuple[list[int], str]  # one message's token ids (-1: a token known only by count) and finish reason


class RequestFailed(Exception):
    """A transport's error for one request (the status and the server's message)."""


class Transport(Protocol):
    name: str  # for the progress bar
    where: str  # the address or URL, for messages
    reattaches: int  # streams re-opened after UNAVAILABLE in this session

    async def open(self, connections: int) -> None: ...

    async def close(self) -> None: ...

    def stream(self, spec: RequestSpec, tag: str) -> AsyncIterator[Tokens]: ...


def build_request(spec: RequestSpec, tag: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(request_id=f"{tag}-{spec.request_id}", sampling=sampling, cache_salt=tag)
    req.token_ids.ids.extend(spec.prompt_ids)
    return req


class GrpcTransport:
    def __init__(self, address: str, api_key: str | None = None):
        self.name, self.where, self.api_key = "requests", address, api_key
        self.reattaches = 0
        self.client: Client | None = None

    async def open(self, connections: int) -> None:
        self.client, self.reattaches = Client(self.where, api_key=self.api_key, reattach_timeout=REATTACH_S), 0
        await self.client.wait_ready(CONNECT_TIMEOUT_S)

    async def close(self) -> None:
        await self.client.close()

    async def stream(self, spec: RequestSpec, tag: str) -> AsyncIterator[Tokens]:
        messages = self.client.generate(build_request(spec, tag))
        try:
            async for msg in messages:
                yield list(msg.token_ids), msg.finish_reason
        except grpc.aio.AioRpcError as e:
            raise RequestFailed(f"{e.code().name}: {e.details()}") from None
        except IncompleteStream:
            return  # reported as a stream without a finish_reason
        finally:
            self.reattaches += messages.reattaches
            await messages.aclose()  # leaving early cancels the call: the server aborts the request


def request_body(spec: RequestSpec, model: str, tag: str, prompt_text: PromptText | None = None) -> dict:
    # A gateway that takes only text prompts (smg) gets the ids decoded; it re-tokenizes them (lengths may shift).
    prompt = prompt_text(spec.prompt_ids) if prompt_text else list(spec.prompt_ids)
    return {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "cache_salt": tag}


class HttpTransport:
    """The API server re-attaches to the scheduler itself, invisibly to this client: `reattaches` stays 0."""

    def __init__(self, base_url: str, api_key: str | None = None, prompt_text: PromptText | None = None):
        self.name, self.where, self.api_key, self.prompt_text = "requests (http)", base_url, api_key, prompt_text
        self.reattaches = 0
        self.client: httpx.AsyncClient | None = None
        self.model = ""

    async def open(self, connections: int) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(base_url=self.where, headers=headers, limits=limits,
                                        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        self.model = await served_model(self.client)

    async def close(self) -> None:
        await self.client.aclose()

    async def stream(self, spec: RequestSpec, tag: str) -> AsyncIterator[Tokens]:
        body = request_body(spec, self.model, tag, self.prompt_text)
        received = 0
        try:
            async with self.client.stream("POST", "/v1/completions", json=body,
                                          headers={"x-request-id": f"{tag}-{spec.request_id}"}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise RequestFailed(f"HTTP {resp.status_code}: {text[:200]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RequestFailed(chunk["error"].get("message", "error"))
                    for choice in chunk["choices"]:
                        ids = choice.get("token_ids")
                        if ids is None:  # no return_token_ids (smg): one token per chunk that carries text
                            ids = [-1] if choice.get("text") else []
                        received += len(ids)
                        yield ids, choice.get("finish_reason") or ""
                    # Tokens that came without text of their own (e.g. half a character) show in the usage only.
                    missing = (chunk.get("usage") or {}).get("completion_tokens", 0) - received
                    if missing > 0:
                        received += missing
                        yield [-1] * missing, ""
        except httpx.HTTPError as e:
            raise RequestFailed(f"{type(e).__name__}: {e}") from None


async def served_model(client: httpx.AsyncClient) -> str:
    """GET /v1/models (retried until the server answers, as a bench client starts): the served model's id."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            resp = await client.get("/v1/models")
            if resp.status_code == 200:
                return resp.json()["data"][0]["id"]
            error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as e:
            error = str(e)
        if time.monotonic() > deadline:
            raise ConnectionError(f"cannot reach the OpenAI API within {CONNECT_TIMEOUT_S:g} s: {error}")
        await asyncio.sleep(0.5)


async def _send(transport: Transport, spec: RequestSpec, tag: str, t0: float,
                limit: asyncio.Semaphore | None) -> RequestResult:
    delay = spec.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    r = RequestResult(spec.request_id, len(spec.prompt_ids), spec.arrival_s)
    async with limit if limit is not None else contextlib.nullcontext():
        r.sent_s = time.perf_counter() - t0
        finish = ""
        try:
            async with contextlib.aclosing(transport.stream(spec, tag)) as messages:
                async for ids, reason in messages:
                    finish = reason or finish
                    now = time.perf_counter() - t0
                    r.output_ids.extend(ids)
                    r.token_times.extend([now] * len(ids))
                    if spec.cancel_after_tokens is not None and r.output_tokens >= spec.cancel_after_tokens \
                            and not finish:
                        r.cancelled = True  # closing the stream makes the server abort the request
                        break
        except RequestFailed as e:
            r.error = str(e)
        r.ok = not r.error and (r.cancelled or bool(finish))
        if not r.ok and not r.error:
            r.error = "stream ended without a finish_reason"
        r.end_s = time.perf_counter() - t0
    return r


async def run(transport: Transport, specs: list[RequestSpec], *, max_concurrency: int | None = None,
              tag: str | None = None, progress: bool = True) -> tuple[list[RequestResult], int]:
    """Send every spec at its arrival time (seconds from now). Returns the results in spec order (times from
    now) and how many times a stream had to re-attach after UNAVAILABLE."""
    tag = tag or uuid.uuid4().hex[:8]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    await transport.open(max_concurrency or max(1, len(specs)))
    try:
        bar = tqdm(total=len(specs), desc=transport.name, unit="req", disable=not progress, file=sys.stderr)
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            r = await _send(transport, spec, tag, t0, limit)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(s) for s in specs))
        bar.close()
    finally:
        await transport.close()
    return list(results), transport.reattaches


async def warm_up(transport: Transport, n: int) -> None:
    """A few short requests before the timed run (first-step costs, tokenizer load); raises if any fails."""
    if n <= 0:
        return
    specs = [RequestSpec(f"warmup-{i}", tuple(range(1000 + i, 1000 + i + WARMUP_PROMPT_TOKENS)), WARMUP_OUTPUT_TOKENS,
                         0.0) for i in range(n)]
    results, _ = await run(transport, specs, tag=f"warmup-{uuid.uuid4().hex[:8]}", progress=False)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up requests to {transport.where} failed: {failed[0]}")
