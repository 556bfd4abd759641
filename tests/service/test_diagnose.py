"""`llmserve diagnose`: verdicts on hand-made metric snapshots of each limit, the histogram percentile helper, the
admission-limit counter in scheduler_svc/metrics.py, benchmark JSON input, and one real stack that preempts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import generate_latest

from common.sampling_fields import SamplingParams
from llmserve import cli
from llmserve.diagnose import diagnose
from llmserve.observation import Observation, Scrape, histogram_quantile, observe_bench, observe_scrapes
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.step_records import SampledToken, SchedulerOutput, WorkerOutput
from scheduler_svc.metrics import Metrics
from tests.support import cluster

ITL_BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
STEP_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


# ---- hand-made exposition text ----------------------------------------------------------------------------------

def _histogram(name: str, bounds, counts: dict[float, int]) -> str:
    """Exposition lines of histogram `name`; `counts` maps a bucket's upper bound to the observations in it."""
    lines, cum = [f"# TYPE {name} histogram"], 0
    for le in bounds:
        cum += counts.get(le, 0)
        lines.append(f'{name}_bucket{{le="{float(le)}",model_name="m"}} {cum}')
    lines.append(f'{name}_bucket{{le="+Inf",model_name="m"}} {cum}')
    lines.append(f'{name}_count{{model_name="m"}} {cum}')
    lines.append(f'{name}_sum{{model_name="m"}} {sum(le * n for le, n in counts.items())}')
    return "\n".join(lines)


def snapshot(*, running=4, waiting=0, kv=0.4, preemptions=0, finished=50, prompt_tokens=5000, blocked=None,
             itl=None, steps=None, queue=None, config=None, counters=True) -> str:
    """A scheduler's /metrics text. `blocked`: {limit: steps}; `itl`/`queue` {bucket bound (s): n}; `steps`:
    {bucket bound (tokens): n}. `counters=False` leaves out the admission counters (an older server)."""
    itl = itl or {0.04: 900, 0.06: 100}
    steps = steps or {8: 100}
    queue = queue or {0.01: finished}
    cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "enable_chunked_prefill": "true",
           "long_prefill_token_threshold": 0, "block_size": 16, "num_gpu_blocks": 64, "kv_bytes_per_block": 1 << 20,
           "max_model_len": 2048, "device": "cpu", **(config or {})}
    parts = [
        "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="m"}} {running}',
        "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="m"}} {waiting}',
        "# TYPE vllm:kv_cache_usage_perc gauge", f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}',
        "# TYPE vllm:num_preemptions counter", f'vllm:num_preemptions_total{{model_name="m"}} {preemptions}',
        "# TYPE vllm:prompt_tokens counter", f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_tokens}',
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {finished}',
        _histogram("vllm:inter_token_latency_seconds", ITL_BOUNDS, itl),
        _histogram("vllm:request_queue_time_seconds", ITL_BOUNDS, queue),
        _histogram("vllm:iteration_tokens_total", STEP_BOUNDS, steps),
    ]
    labels = ",".join(f'{k}="{v}"' for k, v in cfg.items())
    parts += ["# TYPE llmserve:config_info gauge", f'llmserve:config_info{{{labels},model_name="m"}} 1.0']
    if counters:
        parts.append("# TYPE llmserve:admission_blocked_steps counter")
        for lim in ("max_num_seqs", "token_budget", "kv_cache"):
            n = (blocked or {}).get(lim, 0)
            parts.append(f'llmserve:admission_blocked_steps_total{{limit="{lim}",model_name="m"}} {n}')
    return "\n".join(parts) + "\n"


def verdict_of(after: str, before: str | None = None, window_s: float | None = None):
    return diagnose(observe_scrapes(Scrape.parse(after), Scrape.parse(before) if before else None, window_s))


def flags(v) -> dict[str, str]:
    return {s.flag: s.value for s in v.suggestions}


# ---- percentiles ---------------------------------------------------------------------------------------------------

def test_histogram_quantile_interpolates_inside_the_bucket():
    b = [(0.01, 10.0), (0.1, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.05, b) == pytest.approx(0.005)  # half of the first bucket, from 0
    assert histogram_quantile(0.5, b) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert histogram_quantile(0.99, b) == pytest.approx(0.1 + 0.9 * 9 / 10)
    # Observations above the last finite bound: the bound is all a histogram can say.
    assert histogram_quantile(0.99, [(0.5, 50.0), (float("inf"), 100.0)]) == 0.5
    # Empty buckets before the rank are skipped, not interpolated into.
    assert histogram_quantile(0.5, [(1.0, 0.0), (2.0, 0.0), (4.0, 10.0), (float("inf"), 10.0)]) == pytest.approx(3.0)
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_two_scrapes_turn_counters_and_histograms_into_a_window():
    before = snapshot(preemptions=3, finished=10, itl={0.04: 100}, steps={8: 40})
    after = snapshot(preemptions=5, finished=30, itl={0.04: 100, 0.5: 50}, steps={8: 40, 512: 10})
    obs = observe_scrapes(Scrape.parse(after), Scrape.parse(before), 10.0)
    assert (obs.preemptions, obs.requests, obs.steps) == (2, 20, 10)
    # Only the 50 new ITL samples, all in (0.25, 0.5]: the old fast ones no longer pull p50 down.
    assert obs.itl_ms["p50"] == pytest.approx(375.0)
    assert obs.config["max_num_seqs"] == 8 and obs.config["enable_chunked_prefill"] is True
    # A counter that went down: the server restarted, so the second scrape is the whole window.
    obs = observe_scrapes(Scrape.parse(before), Scrape.parse(after), 10.0)
    assert obs.preemptions == 3


# ---- the three limits and a healthy server -------------------------------------------------------------------------

def test_kv_capacity_from_preemptions_and_a_growing_queue():
    before = snapshot(running=6, waiting=2, kv=0.8, preemptions=1, blocked={"kv_cache": 10}, steps={8: 50})
    after = snapshot(running=5, waiting=9, kv=0.97, preemptions=8, finished=60, blocked={"kv_cache": 80},
                     steps={8: 150})
    v = verdict_of(after, before, 10.0)
    assert v.limiter == "kv-capacity"
    text = "\n".join(v.evidence)
    assert "7 preemptions" in text and "70 per 100 finished requests" in text  # 7 over 10 finished in the window
    assert "KV usage 97% while the queue grew 2 -> 9" in text
    assert "free KV blocks were the limit in 100% of them" in text  # 70 of 100 steps queued, all for KV
    # CPU: the pool is 64 blocks of 1 MiB; double it through the memory flag, or the override.
    assert flags(v) == {"--kv-cache-memory": str(128 << 20), "--num-gpu-blocks-override": "128"}


def test_kv_capacity_on_a_gpu_suggests_memory_utilization():
    v = verdict_of(snapshot(waiting=5, kv=0.95, config={"device": "cuda:0"}))  # one scrape, no preemptions
    assert v.limiter == "kv-capacity"
    assert v.evidence[0] == "KV usage 95% with 5 requests waiting"
    assert v.suggestions[0].flag == "--gpu-memory-utilization"


def test_batch_admission_by_max_num_seqs_while_kv_is_free():
    before = snapshot(running=8, waiting=3, kv=0.2, steps={8: 100}, blocked={"max_num_seqs": 10})
    after = snapshot(running=8, waiting=12, kv=0.25, steps={8: 200}, blocked={"max_num_seqs": 90, "kv_cache": 2})
    v = verdict_of(after, before, 10.0)
    assert v.limiter == "batch-admission"
    assert v.evidence[0] == "requests waited after 82% of 100 steps; max-num-seqs was the limit in 98% of them"
    assert "max-num-seqs 8" in v.evidence and "KV usage peak 25%" in v.evidence
    # 8 running hold 25% of the pool: 16 (twice the cap) still stays under 90%.
    assert flags(v) == {"--max-num-seqs": "16"}


def test_batch_admission_seqs_increase_is_capped_by_kv_headroom():
    v = verdict_of(snapshot(running=8, waiting=12, kv=0.6, steps={8: 100}, blocked={"max_num_seqs": 80}))
    assert v.limiter == "batch-admission" and flags(v) == {"--max-num-seqs": "12"}  # 0.9 * 8 / 0.6


def test_batch_admission_by_token_budget():
    v = verdict_of(snapshot(running=3, waiting=20, kv=0.3, steps={512: 100}, blocked={"token_budget": 70}))
    assert v.limiter == "batch-admission"
    assert "the token budget was the limit in 100% of them" in v.evidence[0]
    assert flags(v) == {"--max-num-batched-tokens": "1024"}
    # With an ITL tail the small budget is what bounds it (the opposite advice would follow a raise): no verdict.
    spiky = snapshot(running=3, waiting=20, kv=0.3, steps={512: 100}, blocked={"token_budget": 70},
                     itl={0.04: 970, 0.75: 30})
    assert verdict_of(spiky).limiter == "none"


def test_batch_admission_from_gauges_when_the_admission_counters_are_missing():
    v = verdict_of(snapshot(running=8, waiting=6, kv=0.3, counters=False))
    assert v.limiter == "batch-admission"
    assert v.evidence[0] == "8 running = max-num-seqs with 6 waiting"
    assert flags(v) == {"--max-num-seqs": "16"}
    # The same queue with the pool 80% full: KV is not free, so raising the cap is not the advice.
    assert verdict_of(snapshot(running=8, waiting=6, kv=0.8, counters=False)).limiter == "none"
    # Below the cap the queue is not the cap's doing.
    assert verdict_of(snapshot(running=5, waiting=6, kv=0.3, counters=False)).limiter == "none"


# A mixed load: 970 ITL samples in (20, 40] ms and 30 in (500, 750] ms; 96 decode-sized steps in (16, 32] tokens
# and 4 steps in (1024, 2048] tokens that carried long prompts.
SPIKY_ITL = {0.04: 970, 0.75: 30}
PREFILL_STEPS = {32: 96, 2048: 4}


def test_prefill_interference_with_chunking_off():
    v = verdict_of(snapshot(itl=SPIKY_ITL, steps=PREFILL_STEPS,
                            config={"enable_chunked_prefill": "false", "max_num_batched_tokens": 2048}))
    assert v.limiter == "prefill-interference"
    # p50 = 20 + 20 * 500/970 ms; p99 = 500 + 250 * 20/30 ms.
    assert v.evidence[0] == "ITL p50 30.3 ms, p99 666.7 ms (22.0x, threshold 5x)"
    assert v.evidence[1] == "tokens per step p50 24, p99 1792: some steps carry long prefills"
    assert "chunked prefill is off" in v.evidence[2]
    # 4 x the decode step (24.3 tokens) rounded up to a power of two = 128 tokens per step.
    assert flags(v) == {"--enable-chunked-prefill": "", "--max-num-batched-tokens": "128"}


def test_prefill_interference_with_a_large_budget():
    v = verdict_of(snapshot(itl=SPIKY_ITL, steps=PREFILL_STEPS, config={"max_num_batched_tokens": 8192}))
    assert v.limiter == "prefill-interference"
    assert "token budget 8192 tokens per step (suggested 128)" in v.evidence
    assert flags(v) == {"--max-num-batched-tokens": "128"}


def test_no_prefill_verdict_when_steps_are_already_small_or_uniform():
    # The budget is already at the suggestion: the ITL tail is not the budget's doing.
    assert verdict_of(snapshot(itl=SPIKY_ITL, steps=PREFILL_STEPS, config={"max_num_batched_tokens": 128})
                      ).limiter == "none"
    # Every step about the same size: no prefill spikes to blame.
    assert verdict_of(snapshot(itl=SPIKY_ITL, steps={32: 100}, config={"max_num_batched_tokens": 8192})
                      ).limiter == "none"


def test_healthy_server_says_none_with_its_numbers():
    v = verdict_of(snapshot(running=4, waiting=0, kv=0.4, itl={0.04: 900, 0.06: 100}, steps={8: 100}))
    assert v.limiter == "none" and v.suggestions == [] and v.also == []
    assert "KV usage peak: 40%" in v.numbers and "preemptions: 0" in v.numbers
    assert any(n.startswith("ITL: p50 ") for n in v.numbers)


def test_kv_comes_first_and_other_limits_are_listed_too():
    v = verdict_of(snapshot(waiting=3, kv=0.5, preemptions=4, itl=SPIKY_ITL, steps=PREFILL_STEPS,
                            config={"max_num_batched_tokens": 8192}))
    assert v.limiter == "kv-capacity"
    assert [f.limiter for f in v.also] == ["prefill-interference"]


# ---- benchmark JSON and the command line ---------------------------------------------------------------------------

def test_bench_json_verdicts_and_missing_keys():
    kv = observe_bench({"preemptions": 5, "peak_kv_usage": 1.0, "completed": 50, "itl_ms": {"p50": 20, "p99": 40},
                        "config": {"num_gpu_blocks": 100, "block_size": 16, "device": "cpu"}})
    v = diagnose(kv)
    assert v.limiter == "kv-capacity" and "5 preemptions" in v.evidence[0]
    assert flags(v) == {"--num-gpu-blocks-override": "200"}  # no bytes per block: only the override has a value

    spiky = {"itl_ms": {"p50": 20.0, "p95": 60.0, "p99": 400.0}, "preemptions": 0, "peak_kv_usage": 0.3,
             "server_flags": ["--no-enable-chunked-prefill", "--max-num-batched-tokens=8192", "--max-num-seqs", "64"]}
    obs = observe_bench(spiky)
    assert obs.config == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192, "max_num_seqs": 64}
    v = diagnose(obs)
    assert v.limiter == "prefill-interference" and v.suggestions[0].flag == "--enable-chunked-prefill"
    assert v.suggestions[1].flag == "--max-num-batched-tokens"  # steps unknown: half the budget
    assert v.suggestions[1].value == "4096"

    assert diagnose(observe_bench({})).limiter == "none"
    # Values a run could not measure come as null.
    empty = {"itl_ms": {"p50": None, "p99": None}, "preemptions": None, "peak_kv_usage": None,
             "step_tokens": {"p50": None},
             "server_flags": ["--scheduling-mode", "continuous", "--max-model-len", "4096"]}
    obs = observe_bench(empty)
    assert obs.itl_ms == {} and obs.config == {"max_model_len": 4096}
    assert diagnose(obs).limiter == "none"


def test_cli_reads_snapshots_and_prints_json(tmp_path, capsys):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text(snapshot(preemptions=0))
    after.write_text(snapshot(preemptions=2, waiting=3, kv=0.92))
    cli.main(["diagnose", "--snapshot", str(before), str(after), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["limiter"] == "kv-capacity" and out["source"] == "two snapshots"
    assert out["suggestions"][0]["flag"] == "--kv-cache-memory"

    cli.main(["diagnose", "--snapshot", str(after)])
    text = capsys.readouterr().out
    assert text.startswith("limiter: kv-capacity\n") and "change:\n  --kv-cache-memory" in text


# ---- the metric diagnose relies on ---------------------------------------------------------------------------------

NO_CACHING = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=2, block_size=16, enable_prefix_caching=False)


def _stopped_step(limit: str) -> tuple[SchedulerOutput, SchedulerCore]:
    """A step of the real core (budget 64, 2 seats, block size 16) in which `limit` keeps a request waiting."""
    blocks = {"kv_cache": 3, "preempted": 2}.get(limit, 64)
    core = SchedulerCore(NO_CACHING, BlockPool(blocks))
    prompts = {"max_num_seqs": [4, 4, 4], "token_budget": [100, 4], "kv_cache": [40, 30], "preempted": [16, 16],
               "nobody waits": [4]}[limit]
    for i, n in enumerate(prompts):
        core.add([Request(request_id=f"r{i}", prompt_ids=[1] * n, sampling=SamplingParams(max_tokens=8))])
    out = core.schedule(0.0)
    if limit == "preempted":  # both prompts fill their only block; the next decode needs one more each
        core.update_from_output(out, WorkerOutput([SampledToken(r.request_id, 5) for r in out.scheduled]), 0.0)
        out = core.schedule(0.0)
        assert out.preempted
    return out, core


def test_metrics_attribute_each_queued_step_to_one_limit():
    m = Metrics("m")
    m.set_config(NO_CACHING, num_gpu_blocks=32,
                 kv_bytes_per_block=4096, max_model_len=512, device="cpu")
    for case in ("max_num_seqs", "token_budget", "kv_cache", "preempted", "nobody waits"):
        out, core = _stopped_step(case)
        m.step_done(out, num_running=len(core.running), num_waiting=len(core.waiting), kv_usage=core.pool.usage)
    s = Scrape.parse(generate_latest(m.registry).decode())
    got = {lim: s.total("llmserve:admission_blocked_steps_total", limit=lim)
           for lim in ("max_num_seqs", "token_budget", "kv_cache")}
    assert got == {"max_num_seqs": 1, "token_budget": 1, "kv_cache": 2}
    cfg = s.labels("llmserve:config_info")
    assert (cfg["max_num_seqs"], cfg["max_num_batched_tokens"], cfg["num_gpu_blocks"]) == ("2", "64", "32")
    assert cfg["enable_chunked_prefill"] == "true"


# ---- a real stack that runs out of KV blocks -----------------------------------------------------------------------

def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _run_diagnose(*args: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "llmserve.cli", "diagnose", *args, "--json"], cwd=cluster.ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow  # a whole stack for the CLI; every verdict is tested on metric snapshots above
def test_real_stack_with_a_tiny_pool_is_diagnosed_kv_capacity(redis_server, tmp_path):  # noqa: F811
    # 16 blocks of 16 tokens; four requests of 48-72 prompt + 28 output tokens need up to 4 x 7 blocks.
    worker = cluster.start_worker(["--num-gpu-blocks-override", 16, "--max-model-len", 512,
                                   "--allow-kv-pool-below-max-model-len"])
    metrics_port = cluster.free_port()
    sched = cluster.start_scheduler(redis_server, worker, ["--max-num-batched-tokens", 64,
                                                           "--metrics-port", metrics_port])
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        before = tmp_path / "before.txt"
        before.write_text(_scrape(metrics_port))
        rng = random.Random(7)
        prompts = [[rng.randrange(300, 40000) for _ in range(n)] for n in (48, 56, 64, 72)]
        with grpc.insecure_channel(sched.address) as channel:
            stub = pb_grpc.LLMServeStub(channel)

            def run(ids: list[int]) -> str:
                req = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=28))
                req.token_ids.ids.extend(ids)
                return [m.finish_reason for m in stub.Generate(req, timeout=180)][-1]

            t0 = time.monotonic()
            with ThreadPoolExecutor(len(prompts)) as ex:
                assert list(ex.map(run, prompts)) == ["length"] * len(prompts)
            print(f"load: {time.monotonic() - t0:.1f}s")
        after = tmp_path / "after.txt"
        after.write_text(_scrape(metrics_port))

        # One scrape of the live server: totals since start include the run's preemptions.
        out = _run_diagnose("--url", url, "--interval", "0")
        assert out["limiter"] == "kv-capacity", out
        assert "preemptions" in out["evidence"][0]
        assert out["suggestions"][0]["flag"] == "--kv-cache-memory"
        assert {"flag": "--num-gpu-blocks-override", "value": "32"} == {
            k: out["suggestions"][1][k] for k in ("flag", "value")}
        numbers = "\n".join(out["numbers"])
        assert "num_gpu_blocks=16" in numbers and "max_num_batched_tokens=64" in numbers
        # The window around the run, from real scrapes, says the same.
        assert _run_diagnose("--snapshot", str(before), str(after))["limiter"] == "kv-capacity"
        # Two scrapes of the now idle server: the window holds no preemptions, so no verdict.
        idle = _run_diagnose("--url", url, "--interval", "0.5")
        assert idle["limiter"] == "none" and idle["source"].startswith("two scrapes"), idle
    finally:
        cluster.stop(sched)
        cluster.stop(worker)


def test_observation_defaults_are_unknown_not_zero():
    assert diagnose(Observation(source="x")).limiter == "none"
