"""llmserve/processes.py, the one place that starts processes, and llmserve/serve.py: the worker's and the HTTP
API's command lines of `llmserve serve` come from their settings, ready lines round-trip through their parse
functions, redis-server with an append-only file survives kill -9 on the same port, children die with the process
(main thread) that started them, and nothing else in the repository defines its own copy of these helpers."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import time

import pytest
import redis

from common import config
from common.config import from_namespace
from llmserve import processes, serve
from llmserve.cli import build_parser
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.servers import process as scheduler_server
from worker_svc import server as worker_server
from worker_svc.config import WorkerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- worker settings forwarded from the worker's configuration --------------------------------------------------

def _non_default(f: dataclasses.Field) -> list[str]:
    """Command-line words that give the worker setting `f` a valid value other than its default."""
    m, kind = config.meta(f), config.value_type(WorkerConfig, f.name)
    flag = config.flag(f.name)
    if kind is bool:
        return [flag if not f.default else "--no-" + flag[2:]]
    if m.choices:
        return [flag, next(str(c) for c in m.choices if c != f.default)]
    valid = {"optimization_level": "1", "compilation_config": '{"cache_dir": "/x"}',
             "pooler_config": '{"pooling_type": "MEAN"}', "structured_outputs_config": '{"backend": "xgrammar"}',
             "cpu_omp_threads_bind": "0-1|2-3", "lora_modules": "a=/x/a",
             "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}  # value checks
    value = valid.get(f.name) or {int: "32", float: "0.5"}.get(kind, f"/x/{f.name}")
    return [flag, value]


def test_serve_forwards_every_worker_setting_it_was_given():
    """Every worker setting, given a non-default value to `llmserve serve`, reaches the worker's command line, and
    the worker's own parser reads back the same value (TLS settings stay with the public server)."""
    fields = config.settings(WorkerConfig)
    words = [w for f in fields if f.name not in ("host", "port") for w in _non_default(f)]
    args = build_parser().parse_args(["serve", *words])
    argv = serve.worker_argv(from_namespace(WorkerConfig, args), 50123)
    assert argv[:4] == [argv[0], "-m", "llmserve.cli", "worker"]
    back = build_parser().parse_args(argv[3:])
    assert (back.host, back.port) == ("127.0.0.1", 50123)
    forwarded = [f.name for f in fields if f.name not in serve.SERVE_ONLY | {"host", "port"}]
    assert {"allow_kv_pool_below_max_model_len", "attention_backend", "worker_token", "model",
            "num_gpu_blocks_override", "otlp_traces_endpoint", "max_num_batched_tokens"} <= set(forwarded)
    for name in forwarded:
        assert getattr(back, name) == getattr(args, name), name
    for name in serve.SERVE_ONLY:
        assert getattr(args, name) is not None and getattr(back, name) is None, name


def test_serve_forwards_nothing_left_at_its_default():
    argv = serve.worker_argv(from_namespace(WorkerConfig, build_parser().parse_args(["serve"])), 50123)
    assert argv[3:] == ["worker", "--host", "127.0.0.1", "--port", "50123"]


def test_the_tiny_pool_and_budget_settings_reach_the_worker():
    args = build_parser().parse_args(["serve", "--num-gpu-blocks-override", "16", "--max-model-len", "512",
                                      "--allow-kv-pool-below-max-model-len", "--worker-token", "s3cret",
                                      "--max-num-batched-tokens", "1024"])
    argv = serve.worker_argv(from_namespace(WorkerConfig, args), 1)
    assert "--allow-kv-pool-below-max-model-len" in argv
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "16"
    assert argv[argv.index("--worker-token") + 1] == "s3cret"
    # one setting, two processes: the scheduler's budget is the worker's warm-up step
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "1024"
    assert from_namespace(SchedulerConfig, args).max_num_batched_tokens == 1024


def test_serve_passes_its_shared_settings_to_the_http_api():
    args = build_parser().parse_args(["serve", "--api-key", "k", "--tokenizer", "/t.gguf", "--served-model-name",
                                      "m", "--host", "0.0.0.0", "--http-port", "8123"])
    argv = serve.api_argv(args, from_namespace(serve.ServeConfig, args), 50051)
    back = build_parser().parse_args(argv[3:])
    assert (back.host, back.port, back.scheduler) == ("0.0.0.0", 8123, "127.0.0.1:50051")
    assert (back.api_key, back.tokenizer, back.served_model_name) == ("k", "/t.gguf", ["m"])
    assert back.scheduler_metrics_url is None  # no scheduler metrics port given
    argv = serve.api_argv(args, from_namespace(serve.ServeConfig, args), 50051, metrics_port=9090)
    assert build_parser().parse_args(argv[3:]).scheduler_metrics_url == "http://127.0.0.1:9090/metrics"


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
    serve_line = processes.SERVE_READY_LINE.format(host="0.0.0.0", port=50051, details="model on cpu")
    assert processes.parse_serve_ready_line(f"log\n{serve_line}\n") == ("0.0.0.0", 50051)


def test_wait_ready_reads_only_this_runs_complete_lines(tmp_path):
    log = tmp_path / "w.log"
    log.write_text(worker_server.READY_LINE.format(port=1, epoch="old") + "\n")  # an earlier run's line
    proc = processes.spawn("worker", ["sh", "-c", "printf 'LLMSERVE_WORKER_READY port=2'; sleep 0.3; "
                                  "echo ' epoch=new'; sleep 30"], log_path=str(log))
    try:
        processes.wait_ready(proc, timeout=10)
        assert (proc.port, proc.epoch) == (2, "new")  # not port=1 (old run), not port=2 before the line ended
    finally:
        processes.kill(proc)


def test_wait_ready_names_a_process_that_exits_first(tmp_path):
    proc = processes.spawn("worker", ["sh", "-c", "echo model file missing; exit 3"], log_dir=str(tmp_path))
    with pytest.raises(processes.ProcError, match="exited before it was ready(.|\n)*model file missing"):
        processes.wait_ready(proc, timeout=10)
    assert proc not in processes.live()


# ---- redis-server ------------------------------------------------------------------------------------------------

def test_redis_append_only_file_survives_kill9_on_the_same_port(tmp_path):
    data = str(tmp_path / "redis")
    first = processes.start_redis(data, appendonly=True)
    try:
        redis.Redis.from_url(first.url).set("k", "v")
        processes.kill(first)
        second = processes.start_redis(data, port=first.port, appendonly=True)
        assert second.url == first.url
        assert redis.Redis.from_url(second.url).get("k") == b"v"
    finally:
        processes.stop_all()


def test_redis_extra_args_and_fixed_port(tmp_path):
    port = processes.free_port()
    proc = processes.start_redis(str(tmp_path), port=port, extra_args=["--requirepass", "pw"])
    try:
        assert proc.port == port
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(proc.url).ping()
        assert redis.Redis.from_url(f"redis://:pw@127.0.0.1:{port}/0").ping()
        assert "appendonlydir" not in os.listdir(tmp_path)  # no append-only file unless asked
    finally:
        processes.stop(proc)


# ---- one definition of each ---------------------------------------------------------------------------------------

def _repo_python_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [os.path.join(ROOT, p) for p in out if os.path.exists(os.path.join(ROOT, p)) and "_pb2" not in p]


# A parent that starts a child from its main thread and from a helper thread that has ended, prints both pids, and
# waits to be killed.
_PARENT = """
import sys, threading, time
from llmserve import processes
main = processes.spawn("sleep", ["sleep", "300"], log_dir=sys.argv[1])
other = []
t = threading.Thread(target=lambda: other.append(processes.spawn("sleep", ["sleep", "300"], log_dir=sys.argv[1],
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
    assert defs["free_port"] == ["llmserve/processes.py"]
    assert defs["start_redis"] == ["llmserve/processes.py"]
    assert defs["percentile"] == ["llmserve/bench/metrics.py"]
    assert set(literals["LLMSERVE_WORKER_READY"]) == {"worker_svc/server.py"}
    assert set(literals["LLMSERVE_SCHEDULER_LISTENING"]) == {"scheduler_svc/servers/process.py"}
    assert set(literals["llmserve ready on"]) == {"llmserve/processes.py"}
