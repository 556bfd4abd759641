"""OpenAI's Responses API: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel,
DELETE /v1/responses/{id}.

A response is a chat completion underneath: `instructions` + the conversation (the previous response's, then
`input`) become chat messages, function `tools` / `tool_choice` / `text.format` become the chat fields they
mirror, and the one generation goes through the same bridge, tool plan and constraints as /v1/chat/completions.
What comes back is Responses' shape: output items (`message` with `output_text`, `function_call`), streamed as
typed events (response.created ... response.completed). The request side is api_svc/responses/request.py, the
output side api_svc/responses/output.py; here are the routes.

With `--redis-url` (which `llmserve serve` passes), `store: true` (the default) keeps the response and its
conversation in Redis (api_svc/responses/store.py), so any API process can serve GET, cancel and
`previous_response_id`; a cancel aborts the generation through the scheduler, wherever it runs. Without Redis,
nothing is stored (`store` comes back false).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api_svc import openapi, tools
from api_svc.bridge import Bridge, Generation, chat_request
from api_svc.config import APIConfig
from api_svc.errors import APIError, bad_request
from api_svc.responses.output import Draft, sse
from api_svc.responses.request import ResponsesRequest, chat_body, input_messages, renamed
from api_svc.responses.store import ResponseStore

log = logging.getLogger("llmserve.api")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

    @router.post("/v1/responses", responses=openapi.json_route(openapi.ResponseObject, *openapi.GENERATE, stream=True))
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
            raise renamed(e) from None
        rid = f"resp_{request_id(request)}"
        draft = Draft(body, rid, model, messages, plan, stored=store is not None)
        gen = bridge.generation(chat_request(chat, rid, plan), chat=True)
        try:
            await gen.first()
        except APIError as e:
            raise renamed(e) from None
        if store is not None:  # visible (GET, cancel) from any API process while it runs
            try:
                await store.put(rid, draft.record("in_progress"))
            except APIError:  # Redis is away (a 503): the generation it would have stored is aborted
                await gen.close()
                raise

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
                    yield sse(kind, {"response": head}, seq)
                    seq += 1
                try:
                    async for kind, data in run(draft, gen, store):
                        yield sse(kind, data, seq)
                        seq += 1
                except APIError as e:
                    yield sse("error", {"code": e.code, "message": e.message, "param": e.param}, seq)
                    return
                last = "response.completed" if draft.status == "completed" else "response.incomplete"
                yield sse(last, {"response": draft.response()}, seq)

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
        async for _ in run(draft, gen, store):
            pass
        return JSONResponse(draft.response())

    @router.get("/v1/responses/{response_id}", responses=openapi.json_route(openapi.ResponseObject, *openapi.STORED))
    async def retrieve(response_id: str, request: Request):
        return (await stored(request, response_id))["response"]

    @router.post("/v1/responses/{response_id}/cancel",
                 responses=openapi.json_route(openapi.ResponseObject, *openapi.STORED))
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

    @router.delete("/v1/responses/{response_id}",
                   responses=openapi.json_route(openapi.ResponseDeleted, *openapi.STORED))
    async def delete(response_id: str, request: Request):
        await stored(request, response_id)
        await need_store(request, "delete").delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
