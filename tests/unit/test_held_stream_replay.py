"""Replay (scheduler_svc/servers/held_stream.py): a request replayed from its first token after a stand-down passes
on each sequence's tokens once and in order, prompt logprobs once, and refuses a replay that differs."""

from __future__ import annotations

import pytest

from protos import llmserve_pb2 as pb
from scheduler_svc.servers.held_stream import Diverged, Replay


def msg(index: int, first: int, ids: list[int], finish: str = "", prompt: list[int] | None = None):
    m = pb.GenerateResponse(request_id="r", index=index, first_token_index=first, token_ids=ids,
                            finish_reason=finish)
    for tok in ids:
        m.logprobs.add(token_id=tok, logprob=-1.0)
    if prompt:
        m.prompt_token_ids.extend(prompt)
    return m


def test_a_replay_passes_on_only_the_tokens_not_sent_yet():
    replay = Replay(1)
    assert list(replay.cut(msg(0, 0, [5, 6], prompt=[1, 2])).token_ids) == [5, 6]
    # Stand-down; the replay starts again at token 0 and runs past what was sent.
    out = replay.cut(msg(0, 0, [5, 6, 7], prompt=[1, 2]))
    assert list(out.token_ids) == [7] and out.first_token_index == 2
    assert [lp.token_id for lp in out.logprobs] == [7]
    assert not out.prompt_token_ids, "prompt logprobs went out with the first message already"
    assert list(replay.cut(msg(0, 3, [8], finish="length")).token_ids) == [8]
    assert replay.done == [True]


def test_a_replay_of_only_sent_tokens_is_dropped_and_finished_sequences_stay_finished():
    replay = Replay(2)
    replay.cut(msg(0, 0, [5, 6]))
    replay.cut(msg(1, 0, [9], finish="stop"))
    assert replay.cut(msg(0, 0, [5])) is None
    assert replay.cut(msg(1, 0, [9], finish="stop")) is None, "sequence 1 was finished before the stand-down"
    assert list(replay.cut(msg(0, 1, [6, 7])).token_ids) == [7]


def test_a_replay_that_differs_from_what_was_sent_is_refused():
    replay = Replay(1)
    replay.cut(msg(0, 0, [5, 6]))
    with pytest.raises(Diverged, match=r"sequence 0 was sent tokens \[5, 6\] at position 0.*\[5, 4\]"):
        replay.cut(msg(0, 0, [5, 4, 7]))
