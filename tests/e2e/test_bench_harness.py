"""The benchmark harness (`llmserve bench`): metrics on hand-made timings, workload generators, and one real
sweep (2 modes x 8 requests) through the `llmserve bench sweep` command."""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from llmserve.bench import metrics, workloads
from llmserve.bench.common import RequestResult
from llmserve.bench.runner import server_flags
from llmserve.bench.workloads import WorkloadParams
from scheduler_svc.metrics import Metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- metrics on hand-made timings ----

def test_percentile_interpolates_linearly_between_ranks():
    v = [4.0, 1.0, 3.0, 2.0]
    assert metrics.percentile(v, 0) == 1.0
    assert metrics.percentile(v, 50) == 2.5  # position 1.5
    assert metrics.percentile(v, 95) == pytest.approx(3.85)  # position 2.85
    assert metrics.percentile(v, 100) == 4.0
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) is None
    assert metrics.percentile(list(range(101)), 99) == pytest.approx(99.0)


def _result(rid: str, sent: float, times: list[float], *, ok: bool = True, cancelled: bool = False,
            prompt: int = 10, error: str = "") -> RequestResult:
    return RequestResult(rid, prompt, arrival_s=sent, sent_s=sent, token_times=times,
                         end_s=times[-1] if times else sent + 0.1, output_ids=list(range(len(times))), ok=ok,
                         cancelled=cancelled, error=error)


def test_itl_spreads_a_message_gap_over_its_tokens():
    # Messages: 2 tokens at 1.5, 1 token at 1.7, 2 tokens at 2.0.
    r = _result("a", 1.0, [1.5, 1.5, 1.7, 2.0, 2.0])
    assert metrics.messages(r) == [(1.5, 2), (1.7, 1), (2.0, 2)]
    assert metrics.itl_samples(r) == pytest.approx([0.2, 0.15, 0.15])
    assert sum(metrics.itl_samples(r)) == pytest.approx(2.0 - 1.5)  # the samples add up to last - first token
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.tpot(r) == pytest.approx(0.5 / 4)
    assert metrics.e2e(r) == pytest.approx(1.0)
    assert metrics.itl_samples(_result("b", 0.0, [0.3])) == [] and metrics.tpot(_result("b", 0.0, [0.3])) is None


def test_ttft_counts_from_send_not_from_arrival():
    r = RequestResult("q", 5, arrival_s=1.0, sent_s=3.0, token_times=[3.25], end_s=3.25, output_ids=[1], ok=True)
    assert metrics.ttft(r) == pytest.approx(0.25)


def test_summarize_counts_latencies_and_goodput():
    results = [
        _result("a", 0.0, [0.1, 0.2, 0.3, 0.4]),  # ttft 100 ms, gaps 100 ms
        _result("b", 0.0, [0.3, 0.35, 0.6]),  # ttft 300 ms, gaps 50 and 250 ms
        _result("c", 1.0, [1.2, 1.3], cancelled=True),  # cancelled on purpose after 2 tokens
        _result("d", 1.0, [], ok=False, error="UNAVAILABLE: gone"),
    ]
    s = metrics.summarize(results, duration_s=2.0, slo_ms={"ttft": 200, "itl": 200})
    assert (s["num_requests"], s["completed"], s["cancelled"], s["failed"]) == (4, 2, 1, 1)
    assert s["errors"] == {"UNAVAILABLE: gone": 1}
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 30  # failed requests' prompts excluded
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(19.5)
    # TTFT over completed + cancelled: 100, 300, 200 ms.
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["ttft_ms"]["p99"] == pytest.approx(200 + 100 * 0.98)
    # ITL samples: a 100,100,100; b 50,250; c 100 -> sorted 50,100,100,100,100,250.
    assert s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["itl_ms"]["p95"] == pytest.approx(100 + 150 * 0.75)
    assert s["itl_ms"]["mean"] == pytest.approx(700 / 6)
    # TPOT per request: a 100, b 150, c 100.
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    # e2e over completed only: 400 and 600 ms.
    assert s["e2e_ms"]["p50"] == pytest.approx(500) and s["e2e_ms"]["p95"] == pytest.approx(590)
    # Goodput: a meets both SLOs; b misses ttft (300 > 200) and an ITL gap (250 > 200); c and d don't count.
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    loose = metrics.summarize(results, 2.0, {"ttft": 301, "itl": 251})
    assert loose["good_requests"] == 2
    assert metrics.summarize(results, 2.0, {"tpot": 120})["good_requests"] == 1  # b's TPOT is 150 ms
    assert metrics.summarize(results, 2.0)["goodput"] is None


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:500", "itl:100"]) == {"ttft": 500.0, "itl": 100.0}
    for bad in (["ttft"], ["latency:5"], ["itl:"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert metrics.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert metrics.histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # first bucket starts at 0
    assert metrics.histogram_quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (9.5 - 6) / 4)
    assert metrics.histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # in +Inf: last finite bound
    assert metrics.histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_server_deltas_from_the_schedulers_own_metrics():
    """Queue time and preemptions between two scrapes, read from the names scheduler_svc/metrics.py exports."""
    m = Metrics("smol")
    m.c_queue.observe(30.0)  # before the run: must not count
    m.preempted(5)
    before = metrics.parse_metrics(generate_latest(m.registry).decode())
    for q in (0.1, 0.1, 0.4, 0.4, 0.4, 0.6, 0.6, 0.6, 0.9, 1.2):  # vLLM's queue-time buckets: 0.3, 0.5, 0.8, 1, 1.5
        m.c_queue.observe(q)
    m.preempted(2)
    m.c_kv.set(0.4)
    after = metrics.parse_metrics(generate_latest(m.registry).decode())
    d = metrics.server_deltas(before, after)
    assert d["preemptions"] == 2
    # 10 observations; rank 9.5 falls in the (1.0, 1.5] bucket holding 1 of them: 1.0 + 0.5 * 0.5.
    assert d["queue_time_ms"]["p95"] == pytest.approx(1250.0)
    # rank 5 in (0.3, 0.5] holding observations 3-5: 0.3 + 0.2 * (5 - 2) / 3.
    assert d["queue_time_ms"]["p50"] == pytest.approx(500.0)
    assert metrics.metric_sum(after, "vllm:kv_cache_usage_perc") == pytest.approx(0.4)


def test_mode_flags():
    assert server_flags("chunked", 4096, [])[:4] == ["--scheduling-mode", "continuous", "--max-model-len", "4096"]
    assert "--no-enable-chunked-prefill" not in server_flags("chunked", 4096, [])
    cont = server_flags("continuous", 4096, [])
    assert "--no-enable-chunked-prefill" in cont
    assert cont[cont.index("--max-num-batched-tokens") + 1] == "4096"
    # A user's budget is not overridden.
    assert server_flags("continuous", 4096, ["--max-num-batched-tokens", "8192"]).count("--max-num-batched-tokens") == 1
    naive = server_flags("naive", 1024, ["--x"])
    assert naive[:2] == ["--scheduling-mode", "naive"] and naive[-1] == "--x"
    assert server_flags("continuous", 1024, ["--max-num-batched-tokens=4096"]).count("--max-num-batched-tokens") == 0


# ---- workloads ----

SYNTHETIC = [w for w in workloads.WORKLOADS if w != "trace"]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_workload_is_deterministic_for_a_seed(name):
    p = WorkloadParams(num_requests=16, request_rate=4.0, seed=1)
    a, b = workloads.generate(name, p), workloads.generate(name, p)
    assert a == b and len(a) == 16
    other = workloads.generate(name, WorkloadParams(num_requests=16, request_rate=4.0, seed=2))
    assert [s.prompt_ids for s in other] != [s.prompt_ids for s in a]
    assert [s.arrival_s for s in other] != [s.arrival_s for s in a]
    # The rate moves arrivals only, not the prompts.
    faster = workloads.generate(name, WorkloadParams(num_requests=16, request_rate=8.0, seed=1))
    assert [(s.prompt_ids, s.max_tokens) for s in faster] == [(s.prompt_ids, s.max_tokens) for s in a]
    assert all(workloads.TOKEN_LO <= t < workloads.TOKEN_HI for s in a for t in s.prompt_ids)
    assert len({s.request_id for s in a}) == 16


@pytest.mark.parametrize("name, prompt, output", [("chat", (32, 256), (32, 128)),
                                                   ("long-context", (2048, 6144), (64, 128)),
                                                   ("cancel", (32, 256), (32, 128))])
def test_lengths_stay_in_the_defaults(name, prompt, output):
    specs = workloads.generate(name, WorkloadParams(num_requests=40, seed=3))
    assert all(prompt[0] <= len(s.prompt_ids) <= prompt[1] for s in specs)
    assert all(output[0] <= s.max_tokens <= output[1] for s in specs)
    assert len({len(s.prompt_ids) for s in specs}) > 10  # lengths actually vary
    assert all(s.arrival_s == 0.0 for s in specs)  # rate inf: all at once


def test_overrides_fix_lengths():
    specs = workloads.generate("chat", WorkloadParams(num_requests=8, prompt_len=(50, 50), output_len=(8, 8)))
    assert {len(s.prompt_ids) for s in specs} == {50} and {s.max_tokens for s in specs} == {8}


def test_rag_shares_document_prefixes():
    specs = workloads.generate("rag", WorkloadParams(num_requests=24, seed=0))
    prefixes = [s.prompt_ids[:1024] for s in specs]
    assert len(set(prefixes)) <= 4  # num_docs
    assert max(prefixes.count(p) for p in prefixes) >= 3  # several requests share one document
    assert all(1024 + 16 <= len(s.prompt_ids) <= 1024 + 64 for s in specs)
    assert len({s.prompt_ids for s in specs}) == 24  # the questions differ


def test_rag_num_docs():
    specs = workloads.generate("rag", WorkloadParams(num_requests=16, num_docs=2, long_prompt_len=(64, 64), seed=0))
    assert len({s.prompt_ids[:64] for s in specs}) == 2
    with pytest.raises(ValueError, match="--num-docs"):
        workloads.generate("rag", WorkloadParams(num_docs=0))


def test_fleet_summary_sums_the_pools_and_compares_with_round_robin():
    from types import SimpleNamespace

    from llmserve.bench import fleet

    def counters(requests, hits, queries):
        return {"requests": requests, "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                "prompt_tokens_computed": queries - hits}

    pools = [SimpleNamespace(address="a:1"), SimpleNamespace(address="b:2")]
    zero = counters(2, 0, 32)  # the warm-ups, before the measured run
    summaries = {policy: fleet.fleet_summary(policy, pools, [zero, zero], after) for policy, after in (
        ("cache_aware", [counters(10, 960, 1600), counters(2, 0, 32)]),
        ("round_robin", [counters(6, 320, 832), counters(6, 320, 832)]))}
    ca = summaries["cache_aware"]
    assert [p["requests"] for p in ca["pools"]] == [8, 0] and ca["requests"] == 8
    assert ca["prefix_cache_hits"] == 960 and ca["prefix_hit_rate"] == pytest.approx(960 / 1568)
    assert summaries["round_robin"]["prefix_hit_rate"] == pytest.approx(640 / 1600)
    timing = {"completed": 8, "failed": 0, "ttft_ms": {"p50": 100.0, "p99": 400.0}, "request_throughput": 0.5}
    records = [{**timing, "fleet": summaries["cache_aware"]},
               {**timing, "ttft_ms": {"p50": 200.0, "p99": 400.0}, "fleet": summaries["round_robin"]}]
    table = fleet.markdown_table(records)
    assert "| cache_aware | 2 | 8/0 | 0.612 | 960 | 608 | 100.0 | 400.0 | 0.50 | 8 / 0 |" in table
    assert "cache_aware / round_robin: prefix hits 1.50x, prompt tokens computed 0.63x, TTFT p50 0.50x" in table
    with pytest.raises(SystemExit, match="round_robin"):
        fleet.parse_policies("cache_aware,fastest")


def test_mixed_has_every_kth_prompt_long():
    specs = workloads.generate("mixed", WorkloadParams(num_requests=16, long_share=0.25))
    long = [i for i, s in enumerate(specs) if len(s.prompt_ids) >= 2048]
    assert long == [3, 7, 11, 15]
    assert all(2048 <= len(specs[i].prompt_ids) <= 4096 for i in long)
    assert all(len(s.prompt_ids) <= 256 for i, s in enumerate(specs) if i not in long)


def test_cancel_share():
    specs = workloads.generate("cancel", WorkloadParams(num_requests=20, cancel_share=0.3))
    cancelling = [s for s in specs if s.cancel_after_tokens is not None]
    assert len(cancelling) == 6
    assert all(1 <= s.cancel_after_tokens <= s.max_tokens // 2 for s in cancelling)


def test_burst_groups_arrive_together():
    specs = workloads.generate("burst", WorkloadParams(num_requests=20, burst_size=8))
    assert [s.arrival_s for s in specs] == [0.0] * 8 + [workloads.BURST_IDLE_S] * 8 + [2 * workloads.BURST_IDLE_S] * 4
    timed = workloads.generate("burst", WorkloadParams(num_requests=32, burst_size=8, request_rate=4.0))
    starts = sorted({s.arrival_s for s in timed})
    assert len(starts) == 4 and all(sum(s.arrival_s == t for s in timed) == 8 for t in starts)


def test_trace_round_trip(tmp_path):
    specs = workloads.generate("cancel", WorkloadParams(num_requests=10, request_rate=2.0, seed=5))
    path = str(tmp_path / "trace.jsonl")
    workloads.write_trace(path, specs)
    back = workloads.generate("trace", WorkloadParams(num_requests=0, trace_path=path, seed=5))
    assert [(len(s.prompt_ids), s.max_tokens, s.arrival_s, s.cancel_after_tokens) for s in back] == \
        [(len(s.prompt_ids), s.max_tokens, s.arrival_s, s.cancel_after_tokens) for s in specs]
    assert back == workloads.generate("trace", WorkloadParams(num_requests=0, trace_path=path, seed=5))
    assert len(workloads.generate("trace", WorkloadParams(num_requests=3, trace_path=path))) == 3


def _gaps(rate: float, burstiness: float, n: int = 20000) -> list[float]:
    t = workloads.arrival_times(n, rate, burstiness, seed=7)
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def test_poisson_mean_gap_and_burstiness():
    gaps = _gaps(4.0, 1.0)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Gamma gaps: squared coefficient of variation = 1 / shape.
    cv2 = {}
    for b in (0.25, 1.0, 4.0):
        g = _gaps(4.0, b)
        cv2[b] = statistics.pvariance(g) / statistics.fmean(g) ** 2
    assert cv2[1.0] == pytest.approx(1.0, rel=0.1)
    assert cv2[0.25] == pytest.approx(4.0, rel=0.15)
    assert cv2[4.0] == pytest.approx(0.25, rel=0.1)
    assert statistics.fmean(_gaps(4.0, 0.25)) == pytest.approx(0.25, rel=0.06)  # the mean stays 1/rate
    assert workloads.arrival_times(5, math.inf, 1.0, 0) == [0.0] * 5


def test_kv_waste_flags_reach_its_own_parser():
    from llmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "kv-waste", "--num-requests", "3", "--help"])
    assert args.rest == ["--num-requests", "3", "--help"]


# ---- a real sweep: 2 modes x 8 requests on the bundled model ----

FIELDS = ("command", "started_at", "backend", "mode", "workload", "seed", "request_rate", "burstiness",
          "max_concurrency", "server", "server_flags", "machine", "num_requests", "completed", "cancelled", "failed",
          "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
          "total_token_throughput", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "goodput", "good_requests",
          "queue_time_ms", "queue_time_p95_ms", "preemptions", "reattaches", "peak_kv_usage", "peak_running",
          "peak_rss_mb", "requests")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench"))
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "sweep", "--modes", "chunked,continuous",
           "--request-rates", "inf", "--workload", "cancel", "--cancel-share", "0.25", "--num-requests", "8",
           "--prompt-len", "32:128", "--output-len", "16", "--warmup", "1", "--goodput", "ttft:60000", "itl:60000",
           "--max-model-len", "2048", "--server-args=--num-gpu-blocks-override 512", "--save-requests",
           "--no-progress", "--result-dir", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*_cancel_rateinf_*.json")))]
    return out, proc.stdout, {r["mode"]: r for r in records}


@pytest.mark.slow  # a bench smoke run: two `llmserve serve` launches (~70 s)
def test_sweep_json_has_every_field(sweep):
    _, _, records = sweep
    assert set(records) == {"chunked", "continuous"}
    for mode, r in records.items():
        missing = [f for f in FIELDS if f not in r]
        assert not missing, f"{mode}: {missing}"
        assert r["backend"] == "llmserve" and r["num_requests"] == 8 and r["request_rate"] == "inf"
        assert r["failed"] == 0 and r["cancelled"] == 2 and r["completed"] == 6, r["errors"]
        done = [q for q in r["requests"] if not q["cancelled"]]
        assert all(len(q["output_ids"]) == 16 and len(q["token_times"]) == 16 for q in done)
        cancelled = [q for q in r["requests"] if q["cancelled"]]
        assert all(1 <= len(q["output_ids"]) < 16 for q in cancelled)
        assert r["total_output_tokens"] == 6 * 16 + sum(len(q["output_ids"]) for q in cancelled)
        assert r["ttft_ms"]["p50"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"]
        assert r["itl_ms"]["p50"] > 0 and r["tpot_ms"]["p50"] > 0 and r["e2e_ms"]["p50"] > r["ttft_ms"]["p50"]
        assert r["output_throughput"] > 0 and r["duration_s"] > 0
        assert r["good_requests"] == 6 and r["goodput"] == pytest.approx(6 / r["duration_s"])
        assert r["queue_time_p95_ms"] is not None and r["preemptions"] == 0 and isinstance(r["reattaches"], int)
        assert 0 < r["peak_kv_usage"] <= 1 and r["peak_rss_mb"] > 100 and r["peak_running"] >= 1
        assert r["machine"]["num_blocks"] == 512 and r["machine"]["cpu_count"] >= 1
    assert "--no-enable-chunked-prefill" in records["continuous"]["server_flags"]
    assert "--no-enable-chunked-prefill" not in records["chunked"]["server_flags"]
    assert records["continuous"]["machine"]["max_num_batched_tokens"] == 2048


@pytest.mark.slow  # a bench smoke run: two `llmserve serve` launches (~70 s)
def test_sweep_writes_a_table_and_plots(sweep):
    out, stdout, _ = sweep
    rows = [line for line in stdout.splitlines() if line.startswith("| chunked") or line.startswith("| continuous")]
    assert len(rows) == 2
    assert glob.glob(os.path.join(out, "sweep_cancel_*.md"))
    pngs = glob.glob(os.path.join(out, "sweep_cancel_*.png"))
    assert len(pngs) == 2
    for path in pngs:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
