"""experiments/moe_forward.py in its smoke size: both families, our forward and transformers' on the same
decode steps, the routing share of our step."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_moe_forward_smoke(tmp_path):
    out = tmp_path / "moe.json"
    run_bench("moe_forward", "--layers", 1, "--hidden", 64, "--vocab", 256, "--expert-intermediate", 64,
              "--context", 16, "--batch-sizes", "1,4", "--repeats", 1, "--warmup", 1, "--threads", 1,
              "--json", out, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["batch"]) for r in rows] == [("mixtral", 1), ("mixtral", 4), ("qwen3_moe", 1),
                                                         ("qwen3_moe", 4)]
    for r in rows:
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and 0 < r["routing_share"] < 1
        assert r["first_tokens_agree"]
