"""Harness metrics: what the client saw (latencies, throughput, goodput) and what the server's Prometheus
endpoint and process tree said during the run.

Conventions (stated once, used everywhere):
- Percentiles interpolate linearly between the two nearest ranks (numpy's default): p of sorted v at position
  (n - 1) * p / 100.
- TTFT and end-to-end latency run from when the request was sent (`sent_s`; later than its arrival only when
  --max-concurrency held it back) to its first / last token.
- ITL: a streamed message may carry several tokens (they share one receive time). The gap between two consecutive
  messages is spread evenly over the tokens the later one carries: k tokens after a gap g give k samples of g / k.
  Tokens that came with the first token give no sample. So a request's ITL samples add up to last - first token
  time, and their count is its output tokens minus the first message's.
- TPOT per request: (last token - first token) / (output tokens - 1), for requests with at least two tokens.
- Completed = finished normally; cancelled (the `cancel` workload gave up on purpose) and failed are counted apart.
  Output throughput counts every token received (cancelled requests' too); TTFT/ITL/TPOT use completed and
  cancelled requests; end-to-end latency and goodput only completed ones.
- Goodput: completed requests per second that met every SLO given (TTFT, every ITL sample, TPOT, end-to-end).
"""

from __future__ import annotations

import math
import os
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import psutil
from prometheus_client.parser import text_string_to_metric_families

from llmserve.bench.common import RequestResult
from llmserve.observation import histogram_quantile  # Prometheus-style bucket quantile, shared with diagnose

SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


def percentile(values: list[float], p: float) -> float | None:
    """p-th percentile (0-100) with linear interpolation between ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def distribution_ms(values_s: list[float], ps: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """{p50, p95, p99, mean} in milliseconds of values in seconds (None when there are none)."""
    out: dict[str, float | None] = {f"p{p}": _ms(percentile(values_s, p)) for p in ps}
    out["mean"] = _ms(sum(values_s) / len(values_s)) if values_s else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def messages(r: RequestResult) -> list[tuple[float, int]]:
    """(receive time, tokens) per streamed message, rebuilt from per-token times (a message's tokens share one)."""
    out: list[tuple[float, int]] = []
    for t in r.token_times:
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def itl_samples(r: RequestResult) -> list[float]:
    """A request's inter-token gaps, each message's gap spread evenly over its tokens (module docstring)."""
    msgs = messages(r)
    out = []
    for (prev, _), (t, k) in zip(msgs, msgs[1:], strict=False):
        out += [(t - prev) / k] * k
    return out


def ttft(r: RequestResult) -> float | None:
    if not r.token_times:
        return None
    return r.token_times[0] - (r.sent_s if r.sent_s is not None else r.arrival_s)


def tpot(r: RequestResult) -> float | None:
    if len(r.token_times) < 2:
        return None
    return (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)


def e2e(r: RequestResult) -> float | None:
    if r.end_s is None:
        return None
    return r.end_s - (r.sent_s if r.sent_s is not None else r.arrival_s)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'itl:100'] -> {'ttft': 500.0, 'itl': 100.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}; got {item!r}")
        slo[key] = float(value)
    return slo


def meets_slo(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    checks = {"ttft": lambda: [ttft(r)], "itl": lambda: itl_samples(r), "tpot": lambda: [tpot(r)],
              "e2e": lambda: [e2e(r)]}
    for key, limit in slo_ms.items():
        if any(v is not None and v * 1000 > limit for v in checks[key]()):
            return False
    return True


def summarize(results: list[RequestResult], duration_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    """Client-side metrics of one run (the server-side fields are added by the runner)."""
    completed = [r for r in results if r.ok and not r.cancelled]
    cancelled = [r for r in results if r.ok and r.cancelled]
    failed = [r for r in results if not r.ok]
    served = completed + cancelled
    output_tokens = sum(r.output_tokens for r in results)
    input_tokens = sum(r.prompt_tokens for r in served)
    per = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    out = {
        "num_requests": len(results),
        "completed": len(completed),
        "cancelled": len(cancelled),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common(5)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per(len(completed)),
        "output_throughput": per(output_tokens),
        "total_token_throughput": per(input_tokens + output_tokens),
        "ttft_ms": distribution_ms([v for r in served if (v := ttft(r)) is not None]),
        "itl_ms": distribution_ms([v for r in served for v in itl_samples(r)]),
        "tpot_ms": distribution_ms([v for r in served if (v := tpot(r)) is not None]),
        "e2e_ms": distribution_ms([v for r in completed if (v := e2e(r)) is not None]),
        "goodput_slo_ms": slo_ms or {},
        "good_requests": None,
        "goodput": None,
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in completed)
        out["good_requests"] = good
        out["goodput"] = per(good)
    return out


# ---- server side: Prometheus scrapes and process memory ----

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Sample:
    """Prometheus text format -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout: float = 2.0) -> Sample:
    """One scrape of a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def metric_sum(sample: Sample, name: str, **labels: str) -> float:
    """Sum of `name` over every label set that includes `labels` (e.g. every model_name)."""
    return sum(v for (n, ls), v in sample.items() if n == name and set(labels.items()) <= set(ls))


def summed_metrics(port: int, by_label: bool = False) -> dict[str, float]:
    """Every series of the /metrics page on `port`, its samples summed over labels: {sample name: value}; with
    `by_label` also {"name|label=value": value} per label other than model_name (e.g. one finished_reason)."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape(f"http://127.0.0.1:{port}/metrics", timeout=10).items():
        keys = [name] + ([f"{name}|{k}={v}" for k, v in labels if k != "model_name"] if by_label else [])
        for key in keys:
            out[key] = out.get(key, 0.0) + value
    return out


def histogram_buckets(before: Sample, after: Sample, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram `name` for what happened between two scrapes, summed over
    every other label (e.g. model_name)."""
    def counts(sample: Sample) -> dict[float, float]:
        out: dict[float, float] = {}
        for (n, ls), v in sample.items():
            if n == f"{name}_bucket":
                bound = float(dict(ls)["le"])
                out[bound] = out.get(bound, 0.0) + v
        return out

    b, a = counts(before), counts(after)
    return [(bound, a[bound] - b.get(bound, 0.0)) for bound in sorted(a)]


def server_deltas(before: Sample, after: Sample) -> dict:
    """What the scheduler's /metrics says happened between two scrapes: queue time and step size percentiles
    (from histogram bucket deltas) and preemptions."""
    queue = histogram_buckets(before, after, "vllm:request_queue_time_seconds")
    steps = histogram_buckets(before, after, "vllm:iteration_tokens_total")
    return {
        "queue_time_ms": {f"p{p}": _ms(histogram_quantile(p / 100, queue)) for p in (50, 95, 99)},
        "step_tokens": {f"p{p}": histogram_quantile(p / 100, steps) for p in (50, 95, 99)},
        "preemptions": int(metric_sum(after, "vllm:num_preemptions_total")
                           - metric_sum(before, "vllm:num_preemptions_total")),
    }


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, now."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def tree_hwm(pid: int) -> int | None:
    """Sum of each process's own peak RSS (VmHWM, Linux) over the tree: an upper bound of the tree's peak that
    includes start-up (model loading); None where /proc has no VmHWM."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return None
        total += kb * 1024
    return total


@dataclass
class Peaks:
    kv_usage: float | None = None  # 0-1
    running: int | None = None
    waiting: int | None = None
    rss_bytes: int | None = None


class Watcher:
    """Polls during a run: the scheduler's KV usage and running / waiting gauges (when a metrics URL is known;
    peaks shorter than the poll interval can be missed) and the RSS of
    a process tree (when a pid is known: the launched server, or this process for in-process backends)."""

    def __init__(self, metrics_url: str | None, pid: int | None, interval_s: float = 0.1):
        self.metrics_url, self.pid, self.interval_s = metrics_url, pid, interval_s
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-watcher", daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # one last look, after the final tokens

    def poll(self) -> None:
        if self.metrics_url:
            try:
                sample = scrape(self.metrics_url)
                p = self.peaks
                p.kv_usage = max(p.kv_usage or 0.0, metric_sum(sample, "vllm:kv_cache_usage_perc"))
                p.running = max(p.running or 0, int(metric_sum(sample, "vllm:num_requests_running")))
                p.waiting = max(p.waiting or 0, int(metric_sum(sample, "vllm:num_requests_waiting")))
            except OSError:
                pass  # a missed poll only loses one sample
        if self.pid:
            self.peaks.rss_bytes = max(self.peaks.rss_bytes or 0, tree_rss(self.pid))

    def _loop(self) -> None:
        while True:
            started = time.monotonic()
            self.poll()
            if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                return


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": os.uname().sysname, "machine": os.uname().machine}
