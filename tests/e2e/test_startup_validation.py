"""Start-up validation with real processes: impossible settings exit non-zero with a message naming the flags
and the values."""

import subprocess

import pytest
import redis

from scheduler_svc.ledger.store import SCHEMA_VERSION
from tests.support import cluster
from tests.support.cli_forks import run_cli


def assert_fails(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    for n in needles:
        assert n in out, f"{n!r} not in:\n{out[-3000:]}"


@pytest.mark.parametrize("argv,needles", [
    # budget smaller than the block size (both are flags of `serve`)
    (["--max-num-batched-tokens", 8, "--block-size", 16],
     ["--max-num-batched-tokens", "(8)", "--block-size", "(16)"]),
    # chunked prefill off with a budget below max-model-len
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", 256, "--max-model-len", 512],
     ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "(256)", "--max-model-len", "(512)"]),
    # a block size the kernels cannot use
    (["--block-size", 12], ["--block-size", "power of two", "12"]),
    (["--long-prefill-token-threshold", 64, "--no-enable-chunked-prefill"],
     ["--long-prefill-token-threshold", "--enable-chunked-prefill"]),
])
def test_serve_refuses_impossible_flags(argv, needles):
    assert_fails(run_cli("serve", "--redis-url", "redis://127.0.0.1:1/0", "--port", 0, *argv, timeout=60), *needles)


def test_scheduler_refuses_impossible_flags():
    assert_fails(run_cli("scheduler", "--redis-url", "redis://127.0.0.1:1/0", "--no-enable-chunked-prefill",
                         "--long-prefill-token-threshold", 8), "--long-prefill-token-threshold")
    assert_fails(run_cli("scheduler", "--redis-url", "redis://127.0.0.1:1/0", "--max-num-batched-tokens", 0),
                 "--max-num-batched-tokens", "0")


def test_worker_refuses_max_model_len_above_pool():
    proc = run_cli("worker", "--port", 0, "--device", "cpu", "--num-gpu-blocks-override", 8, "--max-model-len", 512)
    assert_fails(proc, "--max-model-len (512)", "128 tokens", "--num-gpu-blocks-override", "--kv-cache-memory")
    assert_fails(run_cli("worker", "--port", 0, "--block-size", 24), "--block-size", "24")


@pytest.fixture(scope="module")
def worker():
    w = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", "64", "--max-model-len", "512"])
    yield w
    cluster.stop_all()


@pytest.mark.parametrize("argv,needles", [
    (["--max-num-batched-tokens", 8], ["--max-num-batched-tokens", "(8)", "--block-size (16)"]),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", 100],
     ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "(100)", "--max-model-len (512)"]),
])
def test_scheduler_exits_when_the_worker_makes_the_flags_impossible(redis_server, worker, argv, needles):  # noqa: F811
    """A standalone scheduler learns the block size and max-model-len from the worker's Describe."""
    proc = run_cli("scheduler", "--host", "127.0.0.1", "--port", 0, "--redis-url", redis_server, "--namespace",
                   cluster.new_namespace("val"), "--worker-address", worker.address, *argv)
    assert_fails(proc, *needles)


def test_scheduler_refuses_a_pool_of_another_schema_version(redis_server, worker):  # noqa: F811
    """A pool written before schema versions (meta without schema_version) is never read in the new layout."""
    ns = cluster.new_namespace("schema")
    with redis.Redis.from_url(redis_server) as c:
        c.hset(f"{ns}:{{0}}:meta", mapping={"num_blocks": 64, "block_size": 16, "step_id": 0, "arrival_seq": 0})
    proc = run_cli("scheduler", "--host", "127.0.0.1", "--port", 0, "--redis-url", redis_server, "--namespace", ns,
                   "--worker-address", worker.address)
    assert_fails(proc, "no schema_version", "schema_version 1", f"schema_version {SCHEMA_VERSION}", "--namespace")
