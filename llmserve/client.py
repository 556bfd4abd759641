"""`llmserve generate`: stream one request with common.client, which re-attaches by request id if the server goes
away."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.client import Client, IncompleteStream
from common.sampling_wire import public_fields
from common.tls import add_client_tls_args, client_credentials
from protos import llmserve_pb2 as pb


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="one JSON object per streamed message, then a summary")
    p.add_argument("--request-id", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    p.add_argument("--include-stop-str-in-output", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="number of sequences to sample for the prompt")
    p.add_argument("--cache-salt", default="", help="prefix-cache isolation key")
    p.add_argument("--retry-seconds", type=float, default=60.0,
                   help="how long to keep re-attaching while the server answers UNAVAILABLE (restart, fail-over)")
    add_client_tls_args(p)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    s = pb.SamplingParams(stop=args.stop, include_stop_str_in_output=args.include_stop_str_in_output)
    public_fields(lambda name: getattr(args, name, None), s)  # the sampling table's fields that have a flag
    for name in ("max_tokens", "logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    s.n = args.n
    req = pb.GenerateRequest(request_id=args.request_id or uuid.uuid4().hex, sampling=s, priority=args.priority,
                             cache_salt=args.cache_salt)
    if args.chat:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    return req


@dataclass
class Result:
    """What a Generate call delivered, per sequence index, across every re-attach."""

    token_ids: list[list[int]]
    text: list[list[str]]
    finish: list[str | None]
    usage: list[pb.Usage | None]
    reattaches: int = 0  # times the stream was re-opened after UNAVAILABLE


def stream(req: pb.GenerateRequest, address: str, *, api_key: str | None = None,
           credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
           retry_seconds: float = 60.0, on_message: Callable[[pb.GenerateResponse], None] | None = None,
           on_unavailable: Callable[[grpc.RpcError], None] | None = None) -> Result:
    """Run `req` to the end with common.client, re-attaching while the server answers UNAVAILABLE (a scheduler
    restart, fail-over, a Redis or worker restart behind it) for up to `retry_seconds` without a message (a copy
    of a request without an id gets one for that); `on_message` sees each token once. Raises the grpc.RpcError
    of any other failure, or of UNAVAILABLE lasting past `retry_seconds`; IncompleteStream if the server ends
    early."""
    if not req.request_id:  # a copy: the caller may send its request again
        named = pb.GenerateRequest()
        named.CopyFrom(req)
        named.request_id, req = uuid.uuid4().hex, named
    n = max(1, req.sampling.n)
    res = Result([[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [None] * n)

    async def run() -> None:
        async with Client(address, api_key=api_key, credentials=credentials, server_name=server_name,
                          reattach_timeout=retry_seconds) as client:
            async with client.generate(req, on_unavailable=on_unavailable) as messages:
                async for msg in messages:
                    i = msg.index
                    res.token_ids[i].extend(msg.token_ids)
                    res.text[i].append(msg.text)
                    if on_message is not None:
                        on_message(msg)
                    if msg.finish_reason:
                        res.finish[i], res.usage[i] = msg.finish_reason, msg.usage
            res.reattaches = messages.reattaches

    asyncio.run(run())
    return res


def generate(args: argparse.Namespace) -> int:
    req = build_request(args)
    n = max(1, args.n)

    def show(msg: pb.GenerateResponse) -> None:
        if args.json:
            print(json.dumps(_as_dict(msg)), flush=True)
        elif n == 1:
            sys.stdout.write(msg.text)
            sys.stdout.flush()

    def note(e: grpc.RpcError) -> None:
        print(f"[server unavailable ({e.details()}); re-attaching to {req.request_id} for up to "
              f"{args.retry_seconds:g}s]", file=sys.stderr)

    try:
        res = stream(req, args.server, api_key=args.api_key, credentials=client_credentials(args),
                     server_name=args.tls_server_name, retry_seconds=args.retry_seconds, on_message=show,
                     on_unavailable=note)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except IncompleteStream as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    summaries = [{"index": i, "token_ids": res.token_ids[i], "text": "".join(res.text[i]),
                  "finish_reason": res.finish[i], "usage": {"prompt_tokens": res.usage[i].prompt_tokens,
                                                            "completion_tokens": res.usage[i].completion_tokens}}
                 for i in range(n)]
    if args.json:
        final = {k: v for k, v in summaries[0].items() if k != "index"} if n == 1 else {"choices": summaries}
        print(json.dumps({"request_id": req.request_id, **final}))
    elif n == 1:
        print()
    else:
        for summary in summaries:
            print(f"--- [{summary['index']}] ({summary['finish_reason']})\n{summary['text']}")
    return 0


def _as_dict(msg: pb.GenerateResponse) -> dict:
    d = {"request_id": msg.request_id, "index": msg.index, "text": msg.text, "token_ids": list(msg.token_ids)}
    if msg.logprobs:
        d["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                          "top": [[t.token_id, t.logprob] for t in lp.top]} for lp in msg.logprobs]
    if msg.finish_reason:
        d["finish_reason"] = msg.finish_reason
        d["usage"] = {"prompt_tokens": msg.usage.prompt_tokens, "completion_tokens": msg.usage.completion_tokens}
    return d
