"""Running a bench/ script the way its smoke tests do: `python -m bench.NAME` (or `llmserve bench ...`) from the
repository root."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(name: str, *args, timeout: float = 240) -> str:
    """Run bench.NAME without the caller's OTLP settings (a bench starts its own receiver where it needs one);
    fail with its stderr when it exits non-zero; return its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"bench.{name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def run_llmserve_bench(*args, timeout: float = 300) -> str:
    """`llmserve bench ARGS` (the CLI from this tree); fail with its stderr when it exits non-zero; its stdout."""
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"llmserve bench {args[0]} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def require_git_checkout() -> None:
    """A baseline revision is checked out into a temporary git worktree: only possible from a git checkout."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
