"""Polling a condition in a test until it holds, with a message naming what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from llmserve.processes import Proc

T = TypeVar("T")


def wait_for(what: str, cond: Callable[[], T], timeout: float = 120.0, interval: float = 0.02,
             watch: Proc | None = None) -> T:
    """`cond()`'s first truthy value, polled every `interval` seconds; an AssertionError naming `what` after
    `timeout` seconds. With `watch`, that process exiting ends the wait at once (a dead `serve` never makes the
    condition true), and either message ends with the tail of its log."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if watch is not None and not watch.alive():
            raise AssertionError(f"{watch.name} exited while waiting for {what}:\n{watch.log_tail()}")
        if time.monotonic() >= deadline:
            log = f":\n{watch.log_tail()}" if watch is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{log}")
        time.sleep(interval)
    return value
