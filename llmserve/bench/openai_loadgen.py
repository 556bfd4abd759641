"""The load generator over the OpenAI-compatible HTTP API: an asyncio httpx client that sends each RequestSpec at
its arrival time as a streamed /v1/completions request (token-id prompt, greedy, ignore_eos, a fixed max_tokens,
`stream_options.include_usage`), as `vllm bench serve` does, plus vLLM's `return_token_ids` so that every chunk's
tokens get the chunk's receive time, exactly like the gRPC load generator (loadgen.py) records them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable

import httpx
from tqdm import tqdm

from llmserve.bench.common import RequestResult, RequestSpec
from llmserve.bench.loadgen import CONNECT_TIMEOUT_S, WARMUP_OUTPUT_TOKENS, WARMUP_PROMPT_TOKENS

PromptText = Callable[[tuple[int, ...]], str]


def request_body(spec: RequestSpec, model: str, tag: str, prompt_text: PromptText | None = None) -> dict:
    # A gateway that takes only text prompts (smg) gets the ids decoded; it re-tokenizes them (lengths may shift).
    prompt = prompt_text(spec.prompt_ids) if prompt_text else list(spec.prompt_ids)
    return {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "cache_salt": tag}


async def _send(client: httpx.AsyncClient, model: str, spec: RequestSpec, tag: str, t0: float,
                limit: asyncio.Semaphore | None, prompt_text: PromptText | None = None) -> RequestResult:
    delay = spec.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    r = RequestResult(spec.request_id, len(spec.prompt_ids), spec.arrival_s)
    async with limit if limit is not None else contextlib.nullcontext():
        r.sent_s = time.perf_counter() - t0
        finish = ""
        try:
            async with client.stream("POST", "/v1/completions", json=request_body(spec, model, tag, prompt_text),
                                     headers={"x-request-id": f"{tag}-{spec.request_id}"}) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    r.error = f"HTTP {resp.status_code}: {body[:200]}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            r.error = chunk["error"].get("message", "error")
                            break
                        now = time.perf_counter() - t0
                        for choice in chunk["choices"]:
                            ids = choice.get("token_ids")
                            if ids is None:  # no return_token_ids (smg): one token per chunk that carries text
                                ids = [-1] if choice.get("text") else []
                            r.output_ids.extend(ids)
                            r.token_times.extend([now] * len(ids))
                            finish = choice.get("finish_reason") or finish
                        usage = chunk.get("usage") or {}
                        missing = usage.get("completion_tokens", 0) - r.output_tokens
                        if missing > 0:  # tokens that came without text of their own (e.g. half a character)
                            r.output_ids.extend([-1] * missing)
                            r.token_times.extend([now] * missing)
                        if spec.cancel_after_tokens is not None and r.output_tokens >= spec.cancel_after_tokens \
                                and not finish:
                            r.cancelled = True  # leaving the block closes the connection: the server aborts
                            break
                    r.ok = not r.error and (r.cancelled or bool(finish))
                    if not r.ok and not r.error:
                        r.error = "stream ended without a finish_reason"
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"
        r.end_s = time.perf_counter() - t0
    return r


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


def _client(base_url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))


async def run(base_url: str, specs: list[RequestSpec], *, max_concurrency: int | None = None,
              api_key: str | None = None, tag: str | None = None, progress: bool = True,
              prompt_text: PromptText | None = None) -> tuple[list[RequestResult], int]:
    """Send every spec at its arrival time; the results in spec order (and 0 re-attaches: the API server re-attaches
    to the scheduler itself, invisibly to this client)."""
    tag = tag or uuid.uuid4().hex[:8]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _client(base_url, api_key, max_concurrency or max(1, len(specs))) as client:
        model = await served_model(client)
        bar = tqdm(total=len(specs), desc="requests (http)", unit="req", disable=not progress, file=sys.stderr)
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            r = await _send(client, model, spec, tag, t0, limit, prompt_text)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(s) for s in specs))
        bar.close()
    return list(results), 0


async def warm_up(base_url: str, n: int, api_key: str | None = None, prompt_text: PromptText | None = None) -> None:
    if n <= 0:
        return
    specs = [RequestSpec(f"warmup-{i}", tuple(range(1000 + i, 1000 + i + WARMUP_PROMPT_TOKENS)), WARMUP_OUTPUT_TOKENS,
                         0.0) for i in range(n)]
    results, _ = await run(base_url, specs, api_key=api_key, tag=f"warmup-{uuid.uuid4().hex[:8]}", progress=False,
                           prompt_text=prompt_text)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up requests to {base_url} failed: {failed[0]}")
