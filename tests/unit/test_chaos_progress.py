"""The chaos run's progress clock (experiments/chaos_kit/load.py): the next fault waits until a message reaches a
client after the stack serves again. Faults injected while a restarted worker still recomputes add up to one outage
longer than any client's timeout (a run of back-to-back tensor-parallel rank kills lost 3 HTTP streams that way)."""

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
