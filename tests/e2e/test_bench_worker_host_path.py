"""bench/worker_host_path.py runs in its smoke size, as `python -m bench.worker_host_path` from the repository root,
alone and side by side with a baseline revision (HEAD, in a temporary git worktree): both produce the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "bench.worker_host_path", "--smoke", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


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
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    stdout = run("--cases", "mixed", "--baseline-ref", "HEAD")
    assert "mixed 4: sampled tokens and logprobs identical across versions" in stdout
    assert "baseline" in stdout and "current" in stdout
