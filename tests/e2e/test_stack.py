"""llmserve/stack.py, the one place that starts processes: the worker command line of `llmserve serve` comes from the
worker's own parser, ready lines round-trip through their parse functions, redis-server with an append-only file
survives kill -9 on the same port, children die with the process (main thread) that started them, and nothing else
in the repository defines its own copy of these helpers."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time

import pytest
import redis

from llmserve import stack
from llmserve.cli import build_parser
from scheduler_svc import server as scheduler_server
from worker_svc import server as worker_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- worker flags forwarded from the worker's parser ------------------------------------------------------------

def _worker_actions() -> list[argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    worker_server.add_worker_args(p)
    return [a for a in p._actions if a.option_strings]


def _non_default(action: argparse.Action) -> list[str]:
    """Command-line words that give `action` a value other than its default."""
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if isinstance(action, argparse._StoreTrueAction):
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    value = {int: "7", float: "0.5"}.get(action.type, f"/x/{action.dest}")
    return [flag, value]


def test_serve_forwards_every_worker_flag_it_was_given():
    """Every option of `add_worker_args`, given a non-default value to `llmserve serve`, reaches the worker's
    command line, and the worker's own parser reads back the same value (TLS flags stay with the public server)."""
    words = [w for a in _worker_actions() for w in _non_default(a)]
    args = build_parser().parse_args(["serve", *words])
    argv = stack.worker_argv(args, 50123)
    assert argv[:4] == [argv[0], "-m", "llmserve.cli", "worker"]
    back = build_parser().parse_args(argv[3:])
    assert (back.host, back.port) == ("127.0.0.1", 50123)
    forwarded = [a.dest for a in _worker_actions() if a.dest not in stack.SERVE_ONLY]
    assert {"allow_kv_pool_below_max_model_len", "attention_backend", "worker_token", "model",
            "num_gpu_blocks_override", "otlp_traces_endpoint"} <= set(forwarded)
    for dest in forwarded:
        assert getattr(back, dest) == getattr(args, dest), dest
    for dest in stack.SERVE_ONLY:
        assert getattr(args, dest) is not None and getattr(back, dest) is None, dest


def test_serve_forwards_nothing_left_at_its_default():
    argv = stack.worker_argv(build_parser().parse_args(["serve"]), 50123)
    assert argv[3:] == ["worker", "--host", "127.0.0.1", "--port", "50123"]


def test_the_tiny_pool_flags_reach_the_worker():
    args = build_parser().parse_args(["serve", "--num-gpu-blocks-override", "16", "--max-model-len", "512",
                                      "--allow-kv-pool-below-max-model-len", "--worker-token", "s3cret"])
    argv = stack.worker_argv(args, 1)
    assert "--allow-kv-pool-below-max-model-len" in argv
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "16"
    assert argv[argv.index("--worker-token") + 1] == "s3cret"


# ---- ready lines ------------------------------------------------------------------------------------------------

def test_ready_lines_round_trip_through_their_parsers():
    worker_line = worker_server.READY_LINE.format(port=50061, epoch="3f9a")
    assert worker_server.parse_ready_line(worker_line) == (50061, "3f9a")
    assert worker_server.parse_ready_line(f"INFO loading\n{worker_line}\nINFO more\n") == (50061, "3f9a")
    assert worker_server.parse_ready_line("LLMSERVE_WORKER_READY port=1") is None
    listening = scheduler_server.LISTENING_LINE.format(port=50051)
    assert scheduler_server.parse_listening_line(f"x\n{listening}\n") == 50051
    assert scheduler_server.parse_listening_line(worker_line) is None
    from api_svc import server as api_server

    api_line = api_server.LISTENING_LINE.format(port=8000)
    assert api_server.parse_listening_line(f"x\n{api_line}\n") == 8000
    assert api_server.parse_listening_line(listening) is None
    serve_line = stack.SERVE_READY_LINE.format(host="0.0.0.0", port=50051, details="model on cpu")
    assert stack.parse_serve_ready_line(f"log\n{serve_line}\n") == ("0.0.0.0", 50051)


def test_wait_ready_reads_only_this_runs_complete_lines(tmp_path):
    log = tmp_path / "w.log"
    log.write_text(worker_server.READY_LINE.format(port=1, epoch="old") + "\n")  # an earlier run's line
    proc = stack.spawn("worker", ["sh", "-c", "printf 'LLMSERVE_WORKER_READY port=2'; sleep 0.3; "
                                  "echo ' epoch=new'; sleep 30"], log_path=str(log))
    try:
        stack.wait_ready(proc, timeout=10)
        assert (proc.port, proc.epoch) == (2, "new")  # not port=1 (old run), not port=2 before the line ended
    finally:
        stack.kill(proc)


def test_wait_ready_names_a_process_that_exits_first(tmp_path):
    proc = stack.spawn("worker", ["sh", "-c", "echo model file missing; exit 3"], log_dir=str(tmp_path))
    with pytest.raises(stack.ProcError, match="exited before it was ready(.|\n)*model file missing"):
        stack.wait_ready(proc, timeout=10)
    assert proc not in stack.live()


# ---- redis-server ------------------------------------------------------------------------------------------------

def test_redis_append_only_file_survives_kill9_on_the_same_port(tmp_path):
    data = str(tmp_path / "redis")
    first = stack.start_redis(data, appendonly=True)
    try:
        redis.Redis.from_url(first.url).set("k", "v")
        stack.kill(first)
        second = stack.start_redis(data, port=first.port, appendonly=True)
        assert second.url == first.url
        assert redis.Redis.from_url(second.url).get("k") == b"v"
    finally:
        stack.stop_all()


def test_redis_extra_args_and_fixed_port(tmp_path):
    port = stack.free_port()
    proc = stack.start_redis(str(tmp_path), port=port, extra_args=["--requirepass", "pw"])
    try:
        assert proc.port == port
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(proc.url).ping()
        assert redis.Redis.from_url(f"redis://:pw@127.0.0.1:{port}/0").ping()
        assert "appendonlydir" not in os.listdir(tmp_path)  # no append-only file unless asked
    finally:
        stack.stop(proc)


# ---- one definition of each ---------------------------------------------------------------------------------------

def _repo_python_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [os.path.join(ROOT, p) for p in out if os.path.exists(os.path.join(ROOT, p)) and "_pb2" not in p]


# A parent that starts a child from its main thread and from a helper thread that has ended, prints both pids, and
# waits to be killed.
_PARENT = """
import sys, threading, time
from llmserve import stack
main = stack.spawn("sleep", ["sleep", "300"], log_dir=sys.argv[1])
other = []
t = threading.Thread(target=lambda: other.append(stack.spawn("sleep", ["sleep", "300"], log_dir=sys.argv[1],
                                                             die_with_parent=False)))
t.start(); t.join()
print(main.pid, other[0].pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_children_die_with_a_parent_killed_by_sigkill(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    main_child, other_child = map(int, parent.stdout.readline().split())
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert _gone(main_child), "a child started from the main thread outlived its SIGKILLed parent"
        assert not _gone(other_child, timeout=0.5), "die_with_parent=False: the child should stay"
    finally:
        for pid in (main_child, other_child):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_free_port_start_redis_percentile_and_ready_lines_are_defined_once():
    defs: dict[str, list[str]] = {}
    literals: dict[str, list[str]] = {}
    for path in _repo_python_files():
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                defs.setdefault(node.name.lstrip("_"), []).append(rel)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and rel != "tests/e2e/test_stack.py":
                for marker in ("LLMSERVE_WORKER_READY", "LLMSERVE_SCHEDULER_LISTENING", "llmserve ready on"):
                    if marker in node.value:
                        literals.setdefault(marker, []).append(rel)
    assert defs["free_port"] == ["llmserve/stack.py"]
    assert defs["start_redis"] == ["llmserve/stack.py"]
    assert defs["percentile"] == ["llmserve/bench/metrics.py"]
    assert set(literals["LLMSERVE_WORKER_READY"]) == {"worker_svc/server.py"}
    assert set(literals["LLMSERVE_SCHEDULER_LISTENING"]) == {"scheduler_svc/server.py"}
    assert set(literals["llmserve ready on"]) == {"llmserve/stack.py"}
