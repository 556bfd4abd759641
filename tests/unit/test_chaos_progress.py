"""The chaos run's progress clock (experiments/chaos_kit/load.py): the next fault waits until every stream open once
the stack serves again has had a message since. Faults injected while a restarted worker still recomputes add up to
one outage longer than any client's timeout (a run of back-to-back tensor-parallel rank kills lost 3 HTTP streams
that way); so do faults that come as soon as the head of the new leader's queue has a token (the target run of
2026-12-07c lost 11 HTTP streams at its tail that way)"""

from __future__ import annotations

import threading
import time

from experiments.chaos_kit.load import Progress


def test_a_message_after_the_moment_ends_the_wait():
    progress = Progress()
    since = time.monotonic()
    threading.Timer(0.05, progress.mark).start()
    assert progress.wait_after(since, timeout=30)
    assert progress.last > since


def test_a_message_before_the_moment_does_not_count():
    progress = Progress()
    progress.mark()
    since = time.monotonic()
    assert not progress.wait_after(since, timeout=0.05)
    progress.mark()
    assert progress.wait_after(since, timeout=0)


def test_every_stream_open_at_the_moment_must_have_a_message_since():
    # A new leader recomputes its queue from the front: the head's first token is not the tail's.
    progress = Progress()
    progress.open("head")
    progress.open("tail")
    since = time.monotonic()
    progress.mark("head")
    assert not progress.wait_after(since, timeout=0.05)
    assert progress.behind(since) == 1
    progress.mark("tail")
    assert progress.wait_after(since, timeout=0)


def test_a_stream_that_ends_or_opens_later_is_not_waited_for():
    progress = Progress()
    progress.open("ends")
    progress.open("moves")
    since = time.monotonic()
    progress.mark("moves")
    threading.Timer(0.05, progress.close, args=("ends",)).start()
    assert progress.wait_after(since, timeout=30)
    progress.open("later")  # opened after the moment: queued behind the others, not a stall of the fault
    assert progress.wait_after(since, timeout=0)
