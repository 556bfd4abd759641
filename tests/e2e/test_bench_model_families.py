"""experiments/model_families.py in a smoke size: every family's forward against transformers' runs and reports."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_model_families_bench(tmp_path):
    out = tmp_path / "mf.json"
    run_bench("model_families", "--families", "qwen3,gemma2", "--batch-sizes", "1,2", "--context", 20, "--reps", 1,
              "--json", out)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["batch"]) for r in rows] == [("qwen3", 1), ("qwen3", 2), ("gemma2", 1), ("gemma2", 2)]
    assert all(r["ours_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0 for r in rows)
