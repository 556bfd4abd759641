"""OpenAI's Responses API: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel,
DELETE /v1/responses/{id}.

A response is a chat completion underneath: `instructions` + the conversation (the previous response's, then
`input`) become chat messages, function `tools` / `tool_choice` / `text.format` become the chat fields they
mirror, and the one generation goes through the same bridge, tool plan and constraints as /v1/chat/completions.
What comes back is Responses' shape: output items (`message` with `output_text`, `function_call`), streamed as
typed events (response.created ... response.completed).

With `--redis-url` (which `llmserve serve` passes), `store: true` (the default) keeps the response and its
conversation in Redis (api_svc/response_store.py), so any API process can serve GET, cancel and
`previous_response_id`; a cancel aborts the generation through the scheduler, wherever it runs. Without Redis,
nothing is stored (`store` comes back false).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_svc import tools
from api_svc.bridge import Bridge, Generation, chat_request
from api_svc.config import APIConfig
from api_svc.errors import APIError, bad_request
from api_svc.protocol import INT32_MAX, ChatCompletionRequest, SamplingFields
from api_svc.response_store import ResponseStore

log = logging.getLogger("llmserve.api")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Request fields beyond Responses' own that pass to the generation as they are (vLLM's sampling extras).
_NOT_SAMPLING = {"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "response_format",
                 "structured_outputs"}
_SAMPLING_EXTRAS = set(SamplingFields.model_fields) - _NOT_SAMPLING


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentPart(_Open):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(_Open):
    """A message (`role` + `content`), a `function_call` the model made, or a `function_call_output`."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list | dict | None = None


class FunctionTool(_Open):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Open):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """`input` as chat messages: function_call items join into an assistant message's tool_calls,
    function_call_output items become tool messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise bad_request("input is empty: give a string or at least one item", "input")
    out: list[dict] = []
    for k, it in enumerate(body.input):
        if it.type == "message":
            if it.role is None:
                raise bad_request(f"input[{k}].role is missing: user, system, developer or assistant", "input")
            out.append({"role": "system" if it.role == "developer" else it.role, "content": _text(it.content)})
        elif it.type == "function_call":
            if not it.call_id or not it.name:
                raise bad_request(f"input[{k}]: a function_call item needs call_id and name", "input")
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name,
                                                                      "arguments": it.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif it.type == "function_call_output":
            if not it.call_id:
                raise bad_request(f"input[{k}]: a function_call_output item needs call_id", "input")
            output = it.output if isinstance(it.output, str) else json.dumps(it.output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": output})
        # reasoning items carry nothing this server generates: skipped
    return out


def chat_body(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion a response is generated as."""
    chat: dict[str, Any] = {k: v for k, v in (body.model_extra or {}).items() if k in _SAMPLING_EXTRAS}
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat.update(model=body.model, messages=system + messages, max_tokens=body.max_output_tokens,
                temperature=body.temperature, top_p=body.top_p, parallel_tool_calls=body.parallel_tool_calls)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                          "schema": fmt.schema_}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise bad_request(f"input: {where}: {first['msg']}", "input") from None


def _renamed(e: APIError) -> APIError:
    """A chat-shaped error in Responses' field names."""
    names = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
    if e.param in names:
        e.param = names[e.param]
        e.message = e.message.replace("max_tokens", "max_output_tokens")
    return e


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """A response's output items as they form, from content and tool-call deltas (api_svc/tools.py's shape)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def _close(self) -> list[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        at = {"output_index": len(self.items), "item_id": item["id"]}
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [("response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": part}),
                    ("response.output_item.done", {"output_index": at["output_index"], "item": item})]
        return [("response.function_call_arguments.done", {**at, "name": item["name"],
                                                           "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": at["output_index"], "item": item})]

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        """The events of one delta ({"content": ..., "tool_calls": [...]}), in order."""
        events: list[tuple[str, dict]] = []
        index = len(self.items)
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._close()
                index = len(self.items)
                self.open = {"type": "message", "id": _hex_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
                events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.open)}))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.open["content"].append(part)
                events.append(("response.content_part.added", {"output_index": index, "item_id": self.open["id"],
                                                               "content_index": 0, "part": _copy(part)}))
            self.open["content"][0]["text"] += delta["content"]
            events.append(("response.output_text.delta", {"output_index": index, "item_id": self.open["id"],
                                                          "content_index": 0, "delta": delta["content"],
                                                          "logprobs": []}))
        for tc in delta.get("tool_calls", ()):
            fragment = tc["function"].get("arguments", "")
            if "id" in tc:  # a new call
                events += self._close()
                index = len(self.items)
                self.open = {"type": "function_call", "id": _hex_id("fc"), "call_id": tc["id"],
                             "name": tc["function"]["name"], "arguments": "", "status": "in_progress"}
                events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.open)}))
            if fragment and self.open is not None:
                self.open["arguments"] += fragment
                events.append(("response.function_call_arguments.delta", {"output_index": len(self.items),
                                                                          "item_id": self.open["id"],
                                                                          "delta": fragment}))
        return events

    def finish(self) -> list[tuple[str, dict]]:
        return self._close()


def _copy(d: dict) -> dict:
    return json.loads(json.dumps(d))


class Draft:
    """One response being generated: its request, id, conversation and result so far."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, messages: list[dict], plan: tools.ToolPlan | None,
                 stored: bool):
        self.body, self.id, self.model, self.messages, self.plan = body, rid, model, messages, plan
        self.stored = stored
        self.created = int(time.time())
        self.output = Output()
        self.state = plan.choice() if plan is not None else None
        self.finish: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.error: dict | None = None  # a background response that failed

    def feed(self, text: str, finish: str | None, usage) -> list[tuple[str, dict]]:
        final = finish is not None
        if self.state is not None:
            delta = self.state.feed(text, final)
        else:
            delta = {"content": text} if text else {}
        events = self.output.add(delta)
        if final:
            self.finish = finish
            if usage is not None:
                self.usage = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
            events += self.output.finish()
        return events

    @property
    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return {"length": "incomplete", "abort": "cancelled"}.get(self.finish, "completed")

    def response(self, status: str | None = None) -> dict:
        b = self.body
        status = status or self.status
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        tool_choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction) else \
            (b.tool_choice or ("auto" if b.tools else "none"))
        usage = None
        if self.finish is not None:
            usage = {**self.usage, "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"],
                     "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output.items if self.finish is not None else [], "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": b.previous_response_id,
            "temperature": b.temperature, "top_p": b.top_p, "text": {"format": fmt}, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()], "truncation": "disabled",
            "store": self.stored, "background": b.background, "user": b.user, "usage": usage,
        }

    def record(self, status: str | None = None) -> dict:
        """What the store keeps: the response, and the conversation a follow-up continues (its output included)."""
        said = []
        for item in self.output.items:
            if item["type"] == "message":
                said.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if said and "tool_calls" in said[-1]:
                    said[-1]["tool_calls"].append(call)
                else:
                    said.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return {"response": self.response(status), "messages": self.messages + said}


def _sse(kind: str, data: dict, seq: int) -> str:
    payload = json.dumps({"type": kind, "sequence_number": seq, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


def add_routes(router: APIRouter, cfg: APIConfig, bridge_of: Callable[[Request], Bridge],
               check_model: Callable, request_id: Callable[[Request], str]) -> None:
    """The Responses routes on the API's (key-checked) router; `check_model` and `request_id` are app.py's."""
    background: set[asyncio.Task] = set()

    def store_of(request: Request) -> ResponseStore | None:
        return request.app.state.response_store

    def need_store(request: Request, what: str, param: str | None = None) -> ResponseStore:
        store = store_of(request)
        if store is None:
            raise bad_request(f"{what} needs stored responses: start the API with --redis-url", param)
        return store

    async def stored(request: Request, response_id: str) -> dict:
        record = await need_store(request, "this").get(response_id)
        if record is None:
            raise APIError(404, f"no response with id {response_id!r} (never stored, deleted or older than "
                           f"--responses-store-ttl {cfg.responses_store_ttl:g}s)", "NotFoundError", "response_id")
        return record

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    async def run(draft: Draft, gen: Generation, store: ResponseStore | None) -> AsyncIterator[tuple[str, dict]]:
        """The generation's events; the finished response is stored (a cancel stored meanwhile stays). One that
        ends early is stored as failed (an error) or cancelled (its client went away)."""
        try:
            async for delta in gen:
                for ev in draft.feed(delta.text, delta.finish_reason, delta.usage):
                    yield ev
        except BaseException as e:
            if isinstance(e, APIError):
                draft.error = {"code": str(e.code), "message": e.message}
            if store is not None and draft.finish is None:  # not awaited here: the task may be cancelled
                spawn(store.finish(draft.id, draft.record("failed" if draft.error else "cancelled")))
            raise
        if store is not None:
            kept = await store.finish(draft.id, draft.record())
            if kept["response"]["status"] == "cancelled" and draft.status != "cancelled":
                draft.finish = "abort"

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        bridge = bridge_of(request)
        model = await check_model(bridge, body.model)
        store = store_of(request) if body.store else None
        if body.background and store is None:
            raise bad_request("background needs store: true and an API started with --redis-url", "background")
        previous: list[dict] = []
        if body.previous_response_id is not None:
            record = await need_store(request, "previous_response_id", "previous_response_id").get(
                body.previous_response_id)
            if record is None:
                raise APIError(404, f"previous_response_id {body.previous_response_id!r} is not stored (never "
                               "stored, deleted or expired)", "NotFoundError", "previous_response_id")
            if record["response"]["status"] in ("queued", "in_progress"):
                raise bad_request(f"previous_response_id {body.previous_response_id!r} is still in progress",
                                  "previous_response_id")
            previous = record["messages"]
        messages = previous + input_messages(body)
        chat = chat_body(body, messages)
        try:
            plan = tools.plan(chat, cfg.enable_auto_tool_choice, cfg.tool_call_parser)
        except APIError as e:
            raise _renamed(e) from None
        rid = f"resp_{request_id(request)}"
        draft = Draft(body, rid, model, messages, plan, stored=store is not None)
        gen = bridge.generation(chat_request(chat, rid, plan), chat=True)
        try:
            await gen.first()
        except APIError as e:
            raise _renamed(e) from None
        if store is not None:  # visible (GET, cancel) from any API process while it runs
            await store.put(rid, draft.record("in_progress"))

        if body.background:
            async def finish_in_background() -> None:
                with contextlib.suppress(APIError):  # nobody waits for it: the stored response says what failed
                    async for _ in run(draft, gen, store):
                        pass

            spawn(finish_in_background())
            return JSONResponse(draft.response("in_progress"))

        if body.stream:
            async def events() -> AsyncIterator[str]:
                seq = 0
                head = draft.response("in_progress")
                for kind in ("response.created", "response.in_progress"):
                    yield _sse(kind, {"response": head}, seq)
                    seq += 1
                try:
                    async for kind, data in run(draft, gen, store):
                        yield _sse(kind, data, seq)
                        seq += 1
                except APIError as e:
                    yield _sse("error", {"code": e.code, "message": e.message, "param": e.param}, seq)
                    return
                last = "response.completed" if draft.status == "completed" else "response.incomplete"
                yield _sse(last, {"response": draft.response()}, seq)

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
        async for _ in run(draft, gen, store):
            pass
        return JSONResponse(draft.response())

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        return (await stored(request, response_id))["response"]

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        record = await need_store(request, "cancel").cancel(response_id)
        if record is None:
            await stored(request, response_id)  # the 404
        status = record["response"]["status"]
        if status != "cancelled":
            raise bad_request(f"response {response_id!r} is {status}: only a queued or in-progress response can be "
                              "cancelled", "response_id")
        try:  # wherever it runs: the scheduler aborts the generation by its request id
            await bridge_of(request).client.abort(response_id)
        except grpc.aio.AioRpcError as e:  # the scheduler is away: the status is cancelled all the same
            log.info("abort of %s: %s", response_id, e.code().name)
        return record["response"]

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        await stored(request, response_id)
        await need_store(request, "delete").delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
