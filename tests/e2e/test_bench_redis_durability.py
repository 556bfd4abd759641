"""experiments/redis_durability.py in a smoke size: every durability mode runs on its replicated Redis group and
reports tokens/s and commit latencies (the figures in docs/benchmarks.md come from its full size)."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_redis_durability_smoke(tmp_path):
    out = tmp_path / "dur.json"
    run_bench("redis_durability", "--running", 2, "--repeats", 1, "--max-tokens", 8, "--json", out, timeout=600)
    rows = json.loads(out.read_text())
    assert sorted(r["label"] for r in rows) == sorted(["none, everysec", "replica, everysec", "none, always",
                                                       "local, always", "replica, always"])
    for row in rows:
        assert row["tokens"] == 16 and row["tok_s"] > 0 and 0 < row["commit_p50_ms"] <= row["commit_p99_ms"]
