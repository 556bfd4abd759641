"""A streamed chunk written directly as bytes (api_svc/sse.py) equals the dict path's `sse(reply.chunk(...))`."""

from __future__ import annotations

import itertools

import pytest

from api_svc.bridge import Delta
from api_svc.completion_responses import Reply, TokenStrings
from api_svc.sse import ChunkBytes
from api_svc.streaming import sse

TEXTS = ["", "Hello", ' "quoted" \\ back\nslash\t\x00\x1f', "emoji 😀 中文 café \u2028\u2029", "</script>"]


@pytest.mark.parametrize("chat,token_ids", list(itertools.product([False, True], [False, True])))
def test_bytes_equal_dict_path(chat: bool, token_ids: bool) -> None:
    reply = Reply(id='cmpl-"x"\u00e9', model="Smol \"LM\" ☃", n=2, strings=TokenStrings(None), chat=chat,
                  return_token_ids=token_ids)
    fast = ChunkBytes(reply)
    for text, finish, ids in itertools.product(TEXTS, [None, "stop", "length"], [[], [7], [1, 22, 333]]):
        delta = Delta(1, text, ids, [], finish)
        for index in (0, 3):
            assert fast.delta(index, delta) == sse(reply.chunk(index, delta)).encode()
