"""Polling a condition in a test until it holds, with a message naming what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, cond: Callable[[], T], timeout: float = 120.0, interval: float = 0.02) -> T:
    """`cond()`'s first truthy value, polled every `interval` seconds; an AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(interval)
    return value
