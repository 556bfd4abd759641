"""A streamed chunk's SSE bytes, written directly for the common delta (no logprobs): the parts that never change
within a response (id, object, created, model) are encoded once, and each chunk only adds its index, text, finish
reason and token ids. The bytes equal `sse(reply.chunk(...))` (tests/unit/test_sse_bytes.py checks); a delta with
logprobs goes through the dict path."""

from __future__ import annotations

import json

from api_svc.bridge import Delta
from api_svc.completion_responses import Reply

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChunkBytes:
    def __init__(self, reply: Reply):
        head = reply.head("chat.completion.chunk" if reply.chat else "text_completion")
        self._head = ("data: " + _dumps(head)[:-1] + ',"choices":[{"index":').encode()
        self._chat, self._token_ids = reply.chat, reply.return_token_ids

    def delta(self, index: int, delta: Delta) -> bytes:
        finish = "null" if delta.finish_reason is None else _dumps(delta.finish_reason)
        if self._chat:
            body = f'{index},"delta":{{"content":{_dumps(delta.text)}}},"logprobs":null,"finish_reason":{finish}'
        else:
            body = f'{index},"text":{_dumps(delta.text)},"logprobs":null,"finish_reason":{finish},"stop_reason":null'
        if self._token_ids:
            body += ',"token_ids":[' + ",".join(map(str, delta.token_ids)) + "]"
        return self._head + body.encode() + b"}]}\n\n"
