"""A real, throw-away redis-server for tests: `start_redis` and the session fixture `redis_server`.

Use it from a test module with `from tests.redis_fixture import redis_server  # noqa: F401`
(or list the module in `pytest_plugins`). Set LLMSERVE_REDIS_SERVER to use another binary.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

INSTALL_HINT = ("redis-server not found: install it (Debian/Ubuntu: `apt-get install redis-server`, "
                "macOS: `brew install redis`) or point LLMSERVE_REDIS_SERVER at the binary")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_redis(tmpdir: str | Path, timeout_s: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start redis-server on a free loopback port with no persistence; returns (process, url) once PING works."""
    binary = os.environ.get("LLMSERVE_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.path.exists(binary):
        raise RuntimeError(INSTALL_HINT)
    os.makedirs(tmpdir, exist_ok=True)
    last_err = ""
    for _ in range(3):  # the port we picked may be taken before redis binds it: retry with another
        port = _free_port()
        log = open(os.path.join(tmpdir, f"redis-{port}.log"), "wb")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmpdir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with redis.Redis.from_url(url, socket_timeout=1) as c:
                    if c.ping():
                        return proc, url
            except redis.ConnectionError as e:
                last_err = str(e)
            time.sleep(0.02)
        if proc.poll() is None:
            _stop(proc)
        with open(os.path.join(tmpdir, f"redis-{port}.log"), errors="replace") as f:
            last_err = f.read()[-2000:] or last_err
    raise RuntimeError(f"redis-server did not start ({binary}): {last_err}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[str]:
    """URL of a redis-server shared by the test session; killed at the end."""
    try:
        proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield url
    _stop(proc)
