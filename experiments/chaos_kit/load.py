"""The chaos run's load: `concurrency` slots, each running request after request of a seeded mix until told to
stop, over gRPC (common/client.py, which re-attaches by request id) and HTTP (the OpenAI API's SSE stream). The
same specs run again undisturbed for the replay, so every stream can be compared token for token.

Kinds: greedy, seeded (temperature 0.8, a seed), n2 (two seeded sequences), json (json_schema structured output,
HTTP), http (a seeded HTTP stream), cancel (a gRPC stream left after a few tokens: not compared, only counted)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import grpc
import httpx

from common.client import Client, StreamDiverged
from protos import llmserve_pb2 as pb

KINDS = ["greedy", "seeded", "n2", "json", "http", "cancel"]
WEIGHTS = [3, 3, 1, 1, 2, 1]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The weather today is", "A list of prime numbers: 2, 3, 5,", "My favourite recipe starts with",
           "In a hole in the ground there lived", "The quick brown fox", "Dear diary, today I",
           "The three laws of robotics are"]
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False}
REATTACH_S = 300.0  # longer than any recovery: a stream that gives up is lost
RETRY_503_S = 0.5


class Progress:
    """When the streams of the load last received a message (monotonic clock). A fault has passed only once every
    stream that was open when the stack served again has had a message since (or ended), not when health says
    SERVING, nor when the first stream moves: a new leader recomputes its queue from the front, and faults that
    come as soon as the head of the queue has a token leave the streams at its tail without one for good."""

    def __init__(self):
        self._cond = threading.Condition()
        self.last = 0.0
        self._open: dict[object, float] = {}  # open stream -> its last message (its start before the first)

    def open(self, key: object) -> None:
        with self._cond:
            self._open[key] = time.monotonic()

    def close(self, key: object) -> None:
        with self._cond:
            self._open.pop(key, None)
            self._cond.notify_all()

    def mark(self, key: object = None) -> None:
        with self._cond:
            self.last = time.monotonic()
            if key in self._open:
                self._open[key] = self.last
            self._cond.notify_all()

    def wait_after(self, since: float, timeout: float) -> bool:
        """Until a message arrives later than `since` and every stream open then without a message since has had
        one or ended (True), or `timeout` seconds pass (False)."""
        with self._cond:
            behind = [k for k, t in self._open.items() if t <= since]
            return self._cond.wait_for(
                lambda: self.last > since and all(self._open.get(k, since + 1) > since for k in behind), timeout)

    def behind(self, since: float) -> int:
        """Open streams without a message since `since`."""
        with self._cond:
            return sum(t <= since for t in self._open.values())


@dataclass
class Spec:
    index: int
    kind: str
    prompt: str
    max_tokens: int
    seed: int
    cancel_after: int = 0


def make_spec(seed: int, index: int, max_tokens: int) -> Spec:
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choices(KINDS, WEIGHTS)[0]
    return Spec(index, kind, rng.choice(PROMPTS), rng.randint(max_tokens // 2, max_tokens), rng.randrange(1 << 30),
                rng.randint(2, 6) if kind == "cancel" else 0)


@dataclass
class Result:
    spec: Spec
    tokens: list[list[int]] = field(default_factory=list)  # per sequence
    finish: list[str] = field(default_factory=list)
    error: str = ""  # how the stream was lost ("" when it ended normally)
    diverged: bool = False  # StreamDiverged: a replay differed from what was already given
    reattaches: int = 0
    refused: int = 0  # HTTP 503 answers before the stream started, retried
    max_gap_s: float = 0.0  # the longest wait between two messages of the stream
    start: float = 0.0
    end: float = 0.0

    def row(self) -> dict:
        return asdict(self)


class Load:
    """Runs the mix in a thread of its own; `stop()` lets running requests finish and starts no new one; `join()`
    returns every Result in index order. With `specs` it runs exactly those (the replay) and stops by itself."""

    def __init__(self, grpc_address: str, http_url: str, concurrency: int, seed: int, max_tokens: int,
                 specs: list[Spec] | None = None, tag: str = "chaos"):
        self.grpc_address, self.http_url, self.tag = grpc_address, http_url, tag
        self.concurrency, self.seed, self.max_tokens = concurrency, seed, max_tokens
        self.specs = specs
        self.results: list[Result] = []
        self.progress = Progress()
        self._stopping = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name=f"load-{tag}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout: float = 1800) -> list[Result]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"load {self.tag}: streams still running after {timeout:.0f}s")
        return sorted(self.results, key=lambda r: r.spec.index)

    def _take(self) -> Spec | None:
        if self.specs is not None:
            if self._next >= len(self.specs):
                return None
            spec = self.specs[self._next]
        elif self._stopping.is_set():
            return None
        else:
            spec = make_spec(self.seed, self._next, self.max_tokens)
        self._next += 1
        return spec

    async def _run(self) -> None:
        async with Client(self.grpc_address, reattach_timeout=REATTACH_S) as client, \
                httpx.AsyncClient(base_url=self.http_url, timeout=httpx.Timeout(REATTACH_S, connect=10)) as http:
            deadline = time.monotonic() + REATTACH_S
            while (models := await http.get("/v1/models")).status_code == 503 and time.monotonic() < deadline:
                await asyncio.sleep(RETRY_503_S)  # no worker behind the scheduler yet
            self.model = models.json()["data"][0]["id"]
            await asyncio.gather(*(self._slot(client, http) for _ in range(self.concurrency)))

    async def _slot(self, client: Client, http: httpx.AsyncClient) -> None:
        while (spec := self._take()) is not None:
            res = Result(spec, start=time.time())
            self.progress.open(spec.index)
            try:
                if spec.kind in ("json", "http"):
                    await self._http(http, spec, res)
                else:
                    await self._grpc(client, spec, res)
            except StreamDiverged as e:
                res.diverged, res.error = True, f"StreamDiverged: {e}"
            except grpc.aio.AioRpcError as e:
                res.error = f"{e.code().name}: {e.details()}"
            except Exception as e:  # a lost stream of any other kind: reported, never hidden
                res.error = f"{type(e).__name__}: {e}"
            finally:
                self.progress.close(spec.index)
            res.end = time.time()
            self.results.append(res)

    async def _grpc(self, client: Client, spec: Spec, res: Result) -> None:
        n = 2 if spec.kind == "n2" else 1
        sampling = pb.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, n=n,
                                     temperature=0.0 if spec.kind == "greedy" else 0.8, seed=spec.seed)
        req = pb.GenerateRequest(request_id=f"{self.tag}-{spec.index}", text=spec.prompt, sampling=sampling)
        res.tokens, res.finish = [[] for _ in range(n)], [""] * n
        last, got = time.monotonic(), 0
        stream = client.generate(req)
        try:
            async for msg in stream:
                self.progress.mark(spec.index)
                now = time.monotonic()
                res.max_gap_s, last = max(res.max_gap_s, now - last), now
                res.tokens[msg.index] += msg.token_ids
                got += len(msg.token_ids)
                if msg.finish_reason:
                    res.finish[msg.index] = msg.finish_reason
                if spec.kind == "cancel" and got >= spec.cancel_after:
                    res.finish = ["cancelled"]
                    break
        finally:
            res.reattaches = stream.reattaches
            await stream.aclose()

    async def _http(self, http: httpx.AsyncClient, spec: Spec, res: Result) -> None:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
                "return_token_ids": True, "temperature": 0.8, "seed": spec.seed, "ignore_eos": True}
        if spec.kind == "json":  # the grammar ends the object: no ignore_eos, greedy
            body.update(temperature=0.0, ignore_eos=False, structured_outputs={"json": JSON_SCHEMA})
        res.tokens, res.finish = [[]], [""]
        text, last = "", time.monotonic()
        deadline = last + REATTACH_S
        while True:  # 503 before the stream starts ("retry shortly"): retried, as the openai SDK does
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code == 503 and time.monotonic() < deadline:
                    res.refused += 1
                    await asyncio.sleep(RETRY_503_S)
                    continue
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
                text, last = await self._read_sse(resp, res, last)
                break
        if not res.finish[0]:
            raise RuntimeError("the HTTP stream ended without a finish_reason")
        if spec.kind == "json" and res.finish[0] == "stop":
            json.loads(text)  # structured output must parse (ValueError: reported as lost)

    async def _read_sse(self, resp: httpx.Response, res: Result, last: float) -> tuple[str, float]:
        text = ""
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            self.progress.mark(res.spec.index)
            now = time.monotonic()
            res.max_gap_s, last = max(res.max_gap_s, now - last), now
            for choice in chunk.get("choices", []):
                res.tokens[0] += choice.get("token_ids") or []
                text += choice.get("text") or ""
                if choice.get("finish_reason"):
                    res.finish[0] = choice["finish_reason"]
        return text, last
