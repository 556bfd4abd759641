"""`llmserve serve` whose gRPC or HTTP port is held by another process refuses at start, naming the flag and the
port, before it starts any child (rather than restarting a child that can never listen)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.support import cluster


@pytest.mark.parametrize("flag", ["--http-port", "--port"])
def test_serve_refuses_a_port_in_use(flag):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        ports = {"--port": cluster.free_port(), "--http-port": cluster.free_port(), flag: taken}
        argv = [sys.executable, "-m", "llmserve.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                *[str(w) for kv in ports.items() for w in kv]]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode != 0
    assert f"{flag} {taken}" in done.stderr, done.stderr
    assert "in use" in done.stderr, done.stderr
    assert "restarting" not in done.stderr, done.stderr  # refused before any child was started
