"""experiments/lora_throughput.py runs in a smoke size and writes its table's rows."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_lora_throughput(tmp_path):
    out = tmp_path / "lora.json"
    run_bench("lora_throughput", "--ranks", 8, "--adapters", "0,1", "--repeats", 1, "--output-tokens", 3,
              "--concurrency", 4, "--prompt-tokens", 16, "--threads", 2, "--json", out)
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"base-only", "rank 8, 0 adapters", "rank 8, 1 adapters"}
    assert all(r["tok_s"] > 0 for r in rows.values())
