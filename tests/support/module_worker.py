"""A worker process that a module's tests share: started once, stopped however the module ends.

The module fixtures of the end-to-end files that put schedulers in front of one worker (speculation, EAGLE-3 heads,
the compiled forward) all had this shape; what differs between them is the worker's flags and environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from tests.support import cluster


@contextmanager
def running_worker(args: Iterable, env: dict[str, str] | None = None) -> Iterator[cluster.Proc]:
    """`llmserve worker *args` for the body of the with-block; its log holds no traceback once it has stopped."""
    worker = cluster.start_worker(list(args), env=env)
    try:
        yield worker
    finally:
        cluster.stop(worker)
    assert "Traceback" not in worker.log_text(), worker.log_text()[-4000:]
