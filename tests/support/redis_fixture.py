"""The session fixture `redis_server`: the URL of a throw-away redis-server (`llmserve.processes.start_redis`).

tests/conftest.py lists this module in `pytest_plugins`: every test may ask for it by name. Set
LLMSERVE_REDIS_SERVER to use another binary.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmserve.processes import ProcError, start_redis, stop


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[str]:
    """URL of a redis-server shared by the test session (no persistence); stopped at the end."""
    try:
        proc = start_redis(str(tmp_path_factory.mktemp("redis")))
    except ProcError as e:
        pytest.fail(str(e), pytrace=False)
    proc.extra["keep"] = True  # shared by every module: a module's stop_all() leaves it running
    yield proc.url
    stop(proc, timeout=5)
