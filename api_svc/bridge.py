"""The gRPC bridge: OpenAI request bodies -> llmserve.v1 GenerateRequests, and one Generate stream per request
through common.client, which re-attaches by request id after a scheduler fail-over so that the HTTP client sees
one uninterrupted stream.

Stateless: everything a request needs is in its own stream; several API processes may share one scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from api_svc.errors import APIError, bad_request, from_grpc, unavailable
from api_svc.prompt_logprobs import PromptScores
from api_svc.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from api_svc.tools import ToolPlan, history_fields
from common.client import Client, IncompleteStream
from common.sampling_wire import public_fields
from common.tokenizer import Tokenizer, load_tokenizer
from protos import llmserve_pb2 as pb

log = logging.getLogger("llmserve.api")



def _sampling(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    s = pb.SamplingParams(stop=body.stop_list(), n=body.n, include_stop_str_in_output=body.include_stop_str_in_output,
                          skip_special_tokens=body.skip_special_tokens)
    public_fields(lambda name: getattr(body, name), s)  # the sampling table's fields, by name
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if logprobs is not None:
        s.logprobs = logprobs
    _set_constraint(s, body)
    return s


def _set_constraint(s: pb.SamplingParams, body: SamplingFields) -> None:
    """response_format (OpenAI) or structured_outputs (vLLM) -> the one constraint of the request; the scheduler
    checks and compiles it (its 400s name json_schema, regex, choice, grammar or json_object)."""
    given: list[tuple[str, str, object]] = []  # (where the client put it, constraint field, value)
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        given.append(("response_format", "json_schema", rf.json_schema.schema_))
    so = body.structured_outputs
    if so is not None and so.disable_any_whitespace:
        s.disable_any_whitespace = True
    if so is not None:
        for where, field, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                    ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar),
                                    ("json_object", "json_object", so.json_object or None)):
            if value is not None:
                given.append((f"structured_outputs.{where}", field, value))
    if len(given) > 1:
        raise bad_request(f"give one constraint, not {len(given)}: " + ", ".join(g[0] for g in given),
                          given[1][0].partition(".")[0])
    if not given:
        return
    _, field, value = given[0]
    if field == "json_schema":
        s.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif field == "choice":
        s.choice.choices.extend(value)
    elif field == "json_object":
        s.json_object = True
    else:
        setattr(s, field, value)


def completion_requests(body: CompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt (a string, a list of strings, token ids or lists of token ids)."""
    p = body.prompt
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise bad_request("prompt is empty: give a string, a list of strings or token ids", "prompt")
    sampling = _sampling(body, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        sampling.prompt_logprobs = body.logprobs  # the echoed prompt's tokens get logprobs too (OpenAI)
    reqs = []
    for k, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{k}"
        req = pb.GenerateRequest(request_id=rid, sampling=sampling, priority=body.priority,
                                 cache_salt=body.cache_salt or "")
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        reqs.append(req)
    return reqs


def chat_request(body: ChatCompletionRequest, request_id: str, tools: ToolPlan | None = None) -> pb.GenerateRequest:
    """The messages (and tools) go to the scheduler as they are, which renders them with the model's chat template
    exactly as for `llmserve generate --chat`; `tools` enforces or parses tool calls (api_svc/tools.py)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = pb.GenerateRequest(request_id=request_id, sampling=_sampling(body, max_tokens, logprobs),
                             priority=body.priority, cache_salt=body.cache_salt or "")
    for m in body.messages:
        req.chat.messages.add(role=m.role, content=m.text())
    history_fields(req.chat, body.messages)
    if body.tools:
        req.chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools], ensure_ascii=False)
    if tools is not None:
        tools.apply(req)
    return req


@dataclass
class Delta:
    """New output of one sequence since the last Delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[pb.TokenLogprobs]
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    prompt: PromptScores | None = None  # with sampling.prompt_logprobs: in a sequence's first delta


class Generation:
    """One request's Generate stream. `first()` waits for the first output (so that admission errors become HTTP
    errors before any byte is sent); iterating yields every Delta; `close()` (or leaving the iteration early)
    aborts the request in the scheduler."""

    def __init__(self, bridge: Bridge, req: pb.GenerateRequest, chat: bool):
        self.bridge, self.req, self.chat = bridge, req, chat
        # Before the scheduler accepts the request, UNAVAILABLE (no worker yet, draining) is the client's 503.
        self.stream = bridge.client.generate(req, reattach_before_start=False)
        self._events = self._run()
        self._head: Delta | None = None

    @property
    def finished(self) -> bool:
        return self.stream.finished

    async def first(self) -> None:
        try:
            self._head = await self._events.__anext__()
        except StopAsyncIteration:
            raise APIError(502, "the scheduler ended the stream without output", "BadGatewayError") from None
        except BaseException:
            await self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            if self._head is not None:
                head, self._head = self._head, None
                yield head
            async for delta in self._events:
                yield delta
        finally:
            await self.close()

    async def close(self) -> None:
        if self.stream.started and not self.stream.finished:
            self.bridge.abort_later(self.req.request_id)
        await self.stream.aclose()
        await self._events.aclose()

    async def _run(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self.stream:
                finish = msg.finish_reason or None
                prompt = PromptScores(list(msg.prompt_token_ids), list(msg.prompt_logprobs)) \
                    if msg.prompt_token_ids else None
                yield Delta(msg.index, msg.text, list(msg.token_ids), list(msg.logprobs), finish,
                            msg.usage if finish else None, prompt)
        except IncompleteStream:
            raise APIError(502, "the scheduler ended the stream before every sequence finished",
                           "BadGatewayError") from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and self.stream.started:
                raise unavailable(f"the scheduler stayed unavailable for {self.bridge.reattach_timeout:g}s "
                                  f"(--reattach-timeout): {e.details()}") from None
            raise from_grpc(e.code(), e.details() or "", self.chat) from None


@dataclass
class Bridge:
    """The API process's connection to one scheduler address (a load balancer or a leader's address)."""

    address: str
    api_key: str | None = None
    reattach_timeout: float = 60.0
    tokenizer_path: str | None = None
    credentials: grpc.ChannelCredentials | None = None  # TLS to the scheduler (--scheduler-tls-*); None: plaintext
    server_name: str | None = None
    info: pb.ModelInfoResponse | None = None
    tokenizer: Tokenizer | None = None
    tokenizer_error: str | None = None
    _pending: set = field(default_factory=set)

    def __post_init__(self):
        self.client = Client(self.address, api_key=self.api_key, credentials=self.credentials,
                             server_name=self.server_name, reattach_timeout=self.reattach_timeout)
        self._info_lock = asyncio.Lock()
        self._tokenizer_future: asyncio.Future | None = None

    async def model_info(self) -> pb.ModelInfoResponse:
        """The scheduler's model (asked once; then cached); the first answer starts loading the tokenizer."""
        if self.info is not None:
            return self.info
        async with self._info_lock:
            if self.info is None:
                try:
                    info = await self.client.model_info()
                except grpc.aio.AioRpcError as e:
                    raise unavailable(f"the scheduler at {self.address} is not ready: {e.details()}"
                                      f"{self._tls_hint()}") from None
                self._start_tokenizer(self.tokenizer_path or info.model_path)
                self.info = info
        return self.info

    def _start_tokenizer(self, path: str) -> None:
        """Load the tokenizer on a daemon thread (seconds for a GGUF vocabulary; a process that stops meanwhile
        does not wait for it). Only /tokenize, /detokenize, echo and logprobs need it."""
        loop = asyncio.get_running_loop()
        self._tokenizer_future = loop.create_future()

        def load() -> None:
            try:
                tok, error = load_tokenizer(path), None
            except Exception as e:  # noqa: BLE001  (e.g. the model file lives on the scheduler's machine only)
                tok, error = None, (f"cannot load the tokenizer from {path} ({e}); give --tokenizer a GGUF file or "
                                    "an HF directory readable by this process")
            loop.call_soon_threadsafe(self._tokenizer_loaded, tok, error)

        threading.Thread(target=load, name="load-tokenizer", daemon=True).start()

    def _tokenizer_loaded(self, tok: Tokenizer | None, error: str | None) -> None:
        self.tokenizer, self.tokenizer_error = tok, error
        if error:
            log.warning("%s", error)
        self._tokenizer_future.set_result(tok)

    async def get_tokenizer(self) -> Tokenizer:
        await self.model_info()
        tok = await asyncio.shield(self._tokenizer_future)
        if tok is None:
            raise unavailable(self.tokenizer_error or "the tokenizer could not be loaded")
        return tok

    async def wait_info(self, stop: asyncio.Event) -> None:
        """Ask for the model info until the scheduler answers (at start-up, so the first request finds it)."""
        while not stop.is_set() and self.info is None:
            try:
                await self.model_info()
            except APIError:
                await asyncio.sleep(0.5)

    async def health(self) -> str | None:
        """None when this API can serve at once; else why not. Not while its tokenizer is still loading: that takes
        the process's CPU (and the GIL) for 1-2 s, which a first request would wait behind."""
        status = await self.client.health()
        if status != "SERVING":
            return f"the scheduler at {self.address} is {status}{self._tls_hint() if status == 'UNAVAILABLE' else ''}"
        if self._tokenizer_future is not None and not self._tokenizer_future.done():
            return "the API is still loading its tokenizer"
        return None

    def _tls_hint(self) -> str:
        """What a connection the scheduler refuses most likely means (gRPC says only "unavailable")."""
        if self.credentials is None:
            return " (if the scheduler serves TLS, give --scheduler-tls-ca)"
        return (" (over TLS: check that --scheduler-tls-ca signed the scheduler's certificate, and if it has "
                "--tls-client-ca give --scheduler-tls-cert/--scheduler-tls-key)")

    def generation(self, req: pb.GenerateRequest, chat: bool = False) -> Generation:
        return Generation(self, req, chat)

    def abort_later(self, request_id: str) -> None:
        """Abort a request (every sequence of it) without waiting: its HTTP client went away."""
        task = asyncio.get_running_loop().create_task(self._abort(request_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.client.abort(request_id)
        except grpc.aio.AioRpcError as e:  # the stream's cancellation aborts it too
            log.info("abort of %s: %s", request_id, e.code().name)

    async def close(self) -> None:
        await self.client.close()
