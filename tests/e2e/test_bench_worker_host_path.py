"""experiments/worker_host_path.py runs in its smoke size, as `python -m experiments.worker_host_path` from the
repository root, alone and side by side with a baseline revision (HEAD, in a temporary git worktree): both
produce the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import require_git_checkout, run_bench

pytestmark = pytest.mark.slow


def run(*args: str) -> str:
    return run_bench("worker_host_path", "--smoke", *args, timeout=240)


def test_smoke(tmp_path):
    out = tmp_path / "host.json"
    stdout = run("--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    assert {(r["case"], r["decodes"], r["version"]) for r in summary} == {("greedy", 4, "current"),
                                                                        ("mixed", 4, "current")}
    for r in summary:
        assert r["steps"] == 3 and 0 < r["host"]["p50_ms"] < r["total"]["p50_ms"]
    assert "greedy        4 current" in stdout


def test_smoke_against_a_baseline_revision():
    require_git_checkout()
    stdout = run("--cases", "mixed", "--baseline-ref", "HEAD")
    assert "mixed 4: sampled tokens and logprobs identical across versions" in stdout
    assert "baseline" in stdout and "current" in stdout
