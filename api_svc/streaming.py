"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]` at the end; several prompts' streams merged
into one; a client that goes away closes the streams, which aborts their requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from api_svc.bridge import Delta, Generation
from api_svc.completion_responses import Reply
from api_svc.errors import APIError
from api_svc.sse import ChunkBytes

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt number, delta) from every generation as they come; leaving early closes them all."""
    if len(gens) == 1:
        async for delta in gens[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(k: int, gen: Generation) -> None:
        try:
            async for delta in gen:
                await queue.put((k, delta))
            await queue.put(end)
        except BaseException as e:  # noqa: B036  (handed to the consumer, which re-raises it)
            await queue.put(e)

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is end:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def events(reply: Reply, gens: list[Generation], *, want_logprobs: bool,
                 echo: list[str] | None = None) -> AsyncIterator[str | bytes]:
    """The SSE body of a streamed completion or chat completion."""
    offsets: dict[int, int] = {}  # choice -> characters sent (completions' text_offset)
    fast = ChunkBytes(reply)
    echo_later: set[int] = set()  # choices whose echo waits for the prompt logprobs (their first delta has them)
    try:
        for k in range(len(gens)):
            for i in range(reply.n):
                index = k * reply.n + i
                if reply.chat:  # the first chunk of every choice carries the role
                    yield sse(reply.chunk(index, None, text="", first=True))
                elif echo is not None and reply.echo_logprobs:
                    echo_later.add(index)
                    offsets[index] = len(echo[k])
                elif echo is not None:
                    yield sse(reply.chunk(index, None, text=echo[k]))
                    offsets[index] = len(echo[k])
        async for k, delta in merged(gens):
            index = k * reply.n + delta.index
            if index in echo_later:
                echo_later.discard(index)
                yield sse(reply.echo_chunk(index, echo[k], delta.prompt))
            reply.count(k, delta)
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(delta.text)
            # The byte path writes plain deltas; logprobs, tool-call parsing and prompt logprobs need the dict.
            if (want_logprobs and delta.logprobs) or reply.tools is not None \
                    or (reply.prompt_logprobs and delta.prompt):
                chunk = reply.chunk(index, delta, want_logprobs=want_logprobs, text_offset=offset)
                if chunk is not None:  # None: a tool call's text still being parsed
                    yield sse(chunk)
            else:
                yield fast.delta(index, delta)
        if reply.include_usage:
            yield sse(reply.usage_chunk())
    except APIError as e:  # after the first byte the status is sent: the error goes into the stream
        yield sse(e.body())
    yield DONE
