"""experiments/worker_wire.py runs in its smoke size, as `python -m experiments.worker_wire` from the repository root,
alone and side by side with a baseline revision (HEAD, in a temporary git worktree): both produce the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import require_git_checkout, run_bench

pytestmark = pytest.mark.slow


def run(*args: str) -> str:
    return run_bench("worker_wire", "--smoke", *args, timeout=300)


def test_smoke(tmp_path):
    out = tmp_path / "wire.json"
    stdout = run("--json", str(out))
    (row,) = json.loads(out.read_text())["summary"]
    assert (row["running"], row["version"], row["protocol"], row["steps"]) == (4, "current", "llmserve.worker.v2", 3)
    # 4 decodes: 4 one-byte slots and counts plus the header; 4 slots and 4 token ids in the result.
    assert 0 < row["plan_bytes"] < 60 and 0 < row["result_bytes"] < 80
    assert 0 < row["encode"] and 0 < row["result"] and row["wire"] >= row["encode"]
    assert "      4 current   llmserve.worker.v2" in stdout


def test_smoke_against_a_baseline_revision():
    require_git_checkout()
    stdout = run("--baseline-ref", "HEAD")
    assert "4 running: plan 1.0x smaller" in stdout and "outputs identical" in stdout
    assert "baseline" in stdout and "current" in stdout
