"""The FastAPI application: OpenAI's routes (/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models;
/v1/responses in api_svc/responses/routes.py) and vLLM's (/health, /version, /tokenize, /detokenize, /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from api_svc import errors, lora, openapi, tools
from api_svc.bridge import Bridge, Generation, chat_request, completion_requests
from api_svc.completion_responses import ChoiceText, Reply, TokenStrings, whole
from api_svc.config import APIConfig
from api_svc.embeddings import EmbeddingRequest, embeddings
from api_svc.errors import APIError
from api_svc.limits import BodyLimit, check_prompts
from api_svc.metrics import HTTPMetrics, MetricsMiddleware, scheduler_page
from api_svc.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from api_svc.responses import routes as responses_api
from api_svc.responses.store import ResponseStore
from api_svc.streaming import events, merged
from common.tokenizer import CHAT_ROLES

log = logging.getLogger("llmserve.api")
VERSION = "0.1.0"
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _is_type_name(part) -> bool:
    """pydantic names the alternative of a union in an error's location (`str`, `list[int]`): not a field."""
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-")
                                      or part in ("str", "int", "float", "bool"))


def _limit_message(err: dict) -> str | None:
    """A violated upper limit in the scheduler's words (`must be <= 16, got 17`; `has 17 entries, the limit is
    16`), or None for pydantic's own message."""
    ctx = err.get("ctx") or {}
    if err.get("type") == "less_than_equal":
        return f"must be <= {ctx.get('le')}, got {err.get('input')}"
    if err.get("type") == "too_long":
        n = ctx.get("actual_length")  # None: pydantic stopped counting at the limit
        return f"has {n if n is not None else 'more than ' + str(ctx.get('max_length'))} entries, the limit is " \
               f"{ctx.get('max_length')}"
    if err.get("type") == "string_too_long":
        return f"is longer than the limit of {ctx.get('max_length')} characters"
    return None


def create_app(cfg: APIConfig) -> FastAPI:
    metrics = HTTPMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge = Bridge(cfg.scheduler, cfg.scheduler_api_key, cfg.reattach_timeout, cfg.tokenizer,
                        cfg.scheduler_credentials(), cfg.scheduler_tls_server_name)
        app.state.bridge = bridge
        store = app.state.response_store = \
            ResponseStore(cfg.redis_url, cfg.namespace, cfg.responses_store_ttl) if cfg.redis_url else None
        stop = asyncio.Event()
        waiter = asyncio.create_task(bridge.wait_info(stop))  # the model info and tokenizer before the first call
        yield
        stop.set()
        waiter.cancel()
        await bridge.close()
        if store is not None:
            await store.close()

    app = FastAPI(title="llmserve OpenAI-compatible API", version=VERSION, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_request_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError):
        found = e.errors() or [{"loc": (), "msg": "invalid request body", "type": ""}]
        # A union (prompt: string | token ids | ...) fails once per alternative: report a violated limit rather than
        # a type mismatch, and the most specific place.
        first = min(found, key=lambda err: (str(err.get("type", "")).endswith("_type"), -len(err.get("loc", ()))))
        if first.get("type") == "json_invalid":
            return errors.bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                      ).response()
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_name(x)]
        param = loc[0] if loc else None
        where = ".".join(loc)
        msg = _limit_message(first) or first["msg"]
        return errors.bad_request(f"{where}: {msg}" if where else msg, param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):  # FastAPI's own (a body that is not UTF-8, 404, 405)
        return APIError(e.status_code, str(e.detail), "BadRequestError" if e.status_code == 400 else "HTTPError",
                        headers=e.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):
        log.exception("unexpected error")  # the log has the traceback; the client gets a plain message
        return APIError(500, f"internal error: {type(e).__name__}", "InternalServerError").response()

    def bridge_of(request: Request) -> Bridge:
        return request.app.state.bridge

    async def require_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise errors.unauthorized()

    async def served_name(bridge: Bridge) -> str:
        """The first --served-model-name (vLLM: replies carry it), else the scheduler's model name."""
        info = await bridge.model_info()
        return cfg.served_model_name[0] if cfg.served_model_name else info.model_name

    async def check_model(bridge: Bridge, model: str | None) -> str:
        """The name replies carry: the served model's (any --served-model-name is accepted), or the registered LoRA
        adapter's that `model` names."""
        name = await served_name(bridge)
        if model is not None and model != name and model not in (cfg.served_model_name or ()):
            if model not in await lora.adapters(bridge):
                raise errors.model_not_found(model, name)
            return model
        return name

    def request_id(request: Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    v1 = APIRouter(dependencies=[Depends(require_key)])

    @v1.get("/v1/models", responses=openapi.json_route(openapi.ModelList, 401, 500, 503))
    async def models(request: Request):
        bridge = bridge_of(request)
        info = await bridge.model_info()
        name = await served_name(bridge)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "llmserve", "root": info.model_path, "parent": None,
                                            "max_model_len": info.max_model_len},
                                           *lora.model_cards(name, await lora.adapters(bridge), int(time.time()))]}

    async def run(request: Request, gens: list[Generation], reply: Reply, want_logprobs: bool, stream: bool,
                  echo: list[str] | None):
        # Admission errors (bad fields, full queue, no worker) become HTTP errors before any byte.
        started = await asyncio.gather(*(g.first() for g in gens), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            for g in gens:  # the other prompts' requests are aborted
                await g.close()
            raise failed[0]
        if stream:
            return StreamingResponse(events(reply, gens, want_logprobs=want_logprobs, echo=echo),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        choices = [ChoiceText(prefix=echo[k] if echo else "") for k in range(len(gens)) for _ in range(reply.n)]

        async def collect() -> None:
            async for k, delta in merged(gens):
                reply.count(k, delta)
                choices[k * reply.n + delta.index].add(delta)

        # A client that goes away before a whole answer is ready aborts it too (its streams close).
        task = asyncio.create_task(collect())
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        task.result()
        # A whole answer (n sequences, logprobs) can be megabytes of JSON: built off the event loop.
        return await asyncio.to_thread(lambda: JSONResponse(whole(reply, choices, want_logprobs)))

    @v1.post("/v1/completions", responses=openapi.json_route(openapi.Completion, *openapi.GENERATE, stream=True))
    async def completions(body: CompletionRequest, request: Request):
        bridge = bridge_of(request)
        name = await check_model(bridge, body.model)
        rid = request_id(request)
        check_prompts(body.prompt, cfg.max_prompts_per_request, bridge.info.max_model_len)
        reqs = await asyncio.to_thread(completion_requests, body, rid)  # protobuf of up to a whole body
        lora.set_adapter(reqs, name, await served_name(bridge))
        echo = None
        if body.echo:
            tok = await bridge.get_tokenizer()
            echo = await asyncio.to_thread(
                lambda: [r.text if r.WhichOneof("prompt") == "text" else tok.decode(list(r.token_ids.ids))
                         for r in reqs])
        strings = TokenStrings(await bridge.get_tokenizer() if body.logprobs is not None
                               or body.prompt_logprobs is not None else None)
        reply = Reply(f"cmpl-{rid}", name, body.n, strings, chat=False,
                      include_usage=body.include_usage, return_token_ids=body.return_token_ids,
                      echo_logprobs=body.echo and body.logprobs is not None,
                      prompt_logprobs=body.prompt_logprobs is not None)
        gens = [bridge.generation(r) for r in reqs]
        return await run(request, gens, reply, body.logprobs is not None, body.stream, echo)

    @v1.post("/v1/chat/completions",
             responses=openapi.json_route(openapi.ChatCompletion, *openapi.GENERATE, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        bridge = bridge_of(request)
        name = await check_model(bridge, body.model)
        for i, m in enumerate(body.messages):  # checked here too, to name the OpenAI field
            if m.role not in CHAT_ROLES:
                raise errors.bad_request(f"messages[{i}].role {m.role!r} is unknown; allowed: "
                                         f"{', '.join(CHAT_ROLES)}", "messages")
        if not body.messages:
            raise errors.bad_request("messages is empty", "messages")
        rid = request_id(request)
        tool_plan = tools.plan(body, cfg.enable_auto_tool_choice, cfg.tool_call_parser, cfg.reasoning_parser)
        strings = TokenStrings(await bridge.get_tokenizer() if body.logprobs or body.prompt_logprobs is not None
                               else None)
        reply = Reply(f"chatcmpl-{rid}", name, body.n, strings, chat=True, include_usage=body.include_usage,
                      return_token_ids=body.return_token_ids, tools=tool_plan,
                      prompt_logprobs=body.prompt_logprobs is not None)
        chat = await asyncio.to_thread(chat_request, body, rid, tool_plan)
        lora.set_adapter([chat], name, await served_name(bridge))
        gens = [bridge.generation(chat, chat=True)]
        return await run(request, gens, reply, body.logprobs, body.stream, None)

    @v1.post("/v1/embeddings", responses=openapi.json_route(openapi.EmbeddingList, *openapi.GENERATE))
    async def create_embeddings(body: EmbeddingRequest, request: Request):
        bridge = bridge_of(request)
        name = await check_model(bridge, body.model)
        return await embeddings(body, bridge, name, request_id(request))

    @v1.post("/tokenize", responses=openapi.json_route(openapi.Tokens, *openapi.BODY))
    async def tokenize(body: TokenizeRequest, request: Request):
        bridge = bridge_of(request)
        await check_model(bridge, body.model)
        tok = await bridge.get_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("give exactly one of prompt and messages", "prompt")

        def encode() -> list[int]:  # in a worker thread: templates and tokenizing take time proportional to input
            if body.messages is None:
                return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
            except Exception as e:  # a template error from the model's own template names the problem
                raise errors.bad_request(f"the chat template failed on these messages: {e}", "messages") from None
            return tok.encode(text, add_special_tokens=False)

        ids = await asyncio.to_thread(encode)
        body = {"count": len(ids), "max_model_len": bridge.info.max_model_len, "tokens": ids}
        return await asyncio.to_thread(JSONResponse, body)  # not FastAPI's encoder on the loop: ids can be millions

    @v1.post("/detokenize", responses=openapi.json_route(openapi.Text, *openapi.BODY))
    async def detokenize(body: DetokenizeRequest, request: Request):
        bridge = bridge_of(request)
        await check_model(bridge, body.model)
        vocab = bridge.info.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise errors.bad_request(f"tokens contains {bad}, outside the vocabulary [0, {vocab})", "tokens")
        tok = await bridge.get_tokenizer()
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    responses_api.add_routes(v1, cfg, bridge_of, check_model, request_id)  # /v1/responses
    app.include_router(v1)
    app.include_router(lora.lora_router(bridge_of, [Depends(require_key)]))

    @app.get("/health", responses=openapi.HEALTH, response_class=PlainTextResponse)
    async def health(request: Request):
        if (why_not := await bridge_of(request).health()) is not None:
            return errors.unavailable(why_not).response()
        return PlainTextResponse("")

    @app.get("/version", responses=openapi.json_route(openapi.Version))
    async def version():
        return {"version": VERSION}

    @app.get("/metrics", responses=openapi.METRICS, response_class=PlainTextResponse)
    async def prometheus():
        page = await scheduler_page(metrics, cfg.scheduler_metrics_url)
        return PlainTextResponse(page, media_type=CONTENT_TYPE_LATEST)

    openapi.install(app)
    return app
