"""What `llmserve diagnose` reads, as one Observation: a deployment's Prometheus metrics or a benchmark's result.

Inputs: a running scheduler's `/metrics` (two scrapes `--interval` seconds apart, so counters become rates over a
window and a growing queue shows; `--interval 0` scrapes once and reads totals since start), saved metric text
(`--snapshot AFTER` or `--snapshot BEFORE AFTER`), or a benchmark result JSON (`--bench-json`, keys below).

Metrics read (vLLM names plus two of ours, see scheduler_svc/metrics.py): vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:num_preemptions_total, vllm:request_success_total,
vllm:prompt_tokens_total, and the histograms vllm:inter_token_latency_seconds, vllm:time_to_first_token_seconds,
vllm:request_queue_time_seconds, vllm:iteration_tokens_total; llmserve:config_info (the limits in effect) and
llmserve:admission_blocked_steps_total{limit} (steps that left requests waiting, by the limit that stopped
admission); vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total and
vllm:spec_decode_num_accepted_tokens_total (acceptance rate). A server without our two metrics (e.g. vLLM) is
diagnosed from the gauges alone.

Benchmark JSON keys read (each optional): "config" (a dict with the llmserve:config_info label names, e.g.
max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, long_prefill_token_threshold, block_size,
num_gpu_blocks, kv_bytes_per_block, device) or "server_flags" (the server's command-line flags, a list or a
string); "preemptions"; "peak_kv_usage" (0-1); "peak_running"; "peak_waiting"; "completed"; "duration_s";
"ttft_ms", "itl_ms", "queue_ms" (or "queue_time_ms"), "step_tokens": percentile dicts {"p50", "p95", "p99"};
"spec_drafts", "spec_draft_tokens", "spec_accepted_tokens" (speculative decoding counts).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

_INT_CONFIG = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "block_size",
               "num_gpu_blocks", "kv_bytes_per_block", "max_model_len", "num_speculative_tokens")
_BOOL_CONFIG = ("enable_chunked_prefill", "enable_prefix_caching")


# ---- parsed metrics ------------------------------------------------------------------------------------------------

@dataclass
class Scrape:
    """One metrics text: sample name -> [(labels without model_name, value)], summed over model names."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                samples.setdefault(s.name, []).append((labels, s.value))
        return cls(samples)

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of `name`'s samples matching `labels`; None when the server does not export it."""
        if name not in self.samples:
            return None
        return sum(v for lab, v in self.samples[name] if all(lab.get(k) == w for k, w in labels.items()))

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Histogram `name` as sorted (upper bound, cumulative count), summed over label sets."""
        out: dict[float, float] = {}
        for lab, v in self.samples.get(f"{name}_bucket", []):
            le = float(lab["le"])
            out[le] = out.get(le, 0.0) + v
        return sorted(out.items())

    def labels(self, name: str) -> dict[str, str] | None:
        return self.samples[name][0][0] if self.samples.get(name) else None


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile q (0-1) from cumulative buckets [(le, count)], interpolating linearly inside the bucket that holds
    it (as Prometheus' histogram_quantile does); the +Inf bucket gives the largest finite bound. None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        if not math.isinf(le):
            lower_le = le
        lower_count = count
    return lower_le


def _delta(after: float | None, before: float | None) -> float | None:
    if after is None or before is None:
        return after
    return after if after < before else after - before  # smaller after: the server restarted in between


def _bucket_delta(after: list[tuple[float, float]], before: list[tuple[float, float]] | None):
    if not before:
        return after
    old = dict(before)
    if any(count < old.get(le, 0.0) for le, count in after):
        return after
    return [(le, count - old.get(le, 0.0)) for le, count in after]


# ---- what the analysis works on ----------------------------------------------------------------------------------

@dataclass
class Observation:
    """The numbers a verdict is made of, whatever the input. Latencies in ms; None = not known."""

    source: str
    window_s: float | None = None
    config: dict = field(default_factory=dict)
    running: float | None = None
    waiting: float | None = None
    waiting_before: float | None = None  # two scrapes: the queue at the first one
    kv_usage: float | None = None  # the highest usage seen (0-1)
    preemptions: float | None = None
    requests: float | None = None  # finished in the window
    prompt_tokens: float | None = None
    steps: float | None = None
    blocked: dict[str, float] = field(default_factory=dict)  # admission limit -> steps that left requests waiting
    itl_ms: dict[str, float] = field(default_factory=dict)  # {"p50", "p99"}
    ttft_ms: dict[str, float] = field(default_factory=dict)
    queue_ms: dict[str, float] = field(default_factory=dict)
    step_tokens: dict[str, float] = field(default_factory=dict)
    spec_drafts: float | None = None  # speculative decoding: draft runs, draft tokens and accepted ones verified
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None


def _typed_config(raw: dict) -> dict:
    out: dict = {}
    for k, v in raw.items():
        if k in _INT_CONFIG:
            try:
                out[k] = int(v)
            except (TypeError, ValueError):
                continue
        elif k in _BOOL_CONFIG:
            out[k] = v if isinstance(v, bool) else str(v).lower() in ("true", "1", "yes", "on")
        else:
            out[k] = v
    return out


def _percentiles(buckets: list[tuple[float, float]], scale: float = 1.0) -> dict[str, float]:
    out = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        v = histogram_quantile(q, buckets)
        if v is not None:
            out[name] = v * scale
    return out


def observe_scrapes(after: Scrape, before: Scrape | None = None, window_s: float | None = None) -> Observation:
    """Counters and histograms over the window between two scrapes (or totals since start for one); gauges as last
    seen, KV usage as the highest of the scrapes."""
    if before is None:
        source = "one scrape: counters are totals since the server started"
    else:
        source = f"two scrapes {window_s:.1f} s apart" if window_s else "two snapshots"

    def counter(name: str, **labels: str) -> float | None:
        return _delta(after.total(name, **labels), before.total(name, **labels) if before else None)

    def hist(name: str) -> list[tuple[float, float]]:
        return _bucket_delta(after.buckets(name), before.buckets(name) if before else None)

    usages = [s.total("vllm:kv_cache_usage_perc") for s in (before, after) if s is not None]
    usages = [u for u in usages if u is not None]
    blocked = {}
    for lim in ("max_num_seqs", "token_budget", "kv_cache"):
        v = counter("llmserve:admission_blocked_steps_total", limit=lim)
        if v is not None:
            blocked[lim] = v
    return Observation(
        source=source, window_s=window_s, config=_typed_config(after.labels("llmserve:config_info") or {}),
        running=after.total("vllm:num_requests_running"), waiting=after.total("vllm:num_requests_waiting"),
        waiting_before=before.total("vllm:num_requests_waiting") if before else None,
        kv_usage=max(usages) if usages else None, preemptions=counter("vllm:num_preemptions_total"),
        requests=counter("vllm:request_success_total"), prompt_tokens=counter("vllm:prompt_tokens_total"),
        steps=counter("vllm:iteration_tokens_total_count"), blocked=blocked,
        itl_ms=_percentiles(hist("vllm:inter_token_latency_seconds"), 1000.0),
        ttft_ms=_percentiles(hist("vllm:time_to_first_token_seconds"), 1000.0),
        queue_ms=_percentiles(hist("vllm:request_queue_time_seconds"), 1000.0),
        step_tokens=_percentiles(hist("vllm:iteration_tokens_total")),
        spec_drafts=counter("vllm:spec_decode_num_drafts_total"),
        spec_draft_tokens=counter("vllm:spec_decode_num_draft_tokens_total"),
        spec_accepted_tokens=counter("vllm:spec_decode_num_accepted_tokens_total"))


def _config_from_flags(flags) -> dict:
    """`--max-num-seqs 8`, `--max-num-seqs=8`, `--no-enable-chunked-prefill` ... -> config_info keys."""
    args = shlex.split(flags) if isinstance(flags, str) else [str(a) for a in flags]
    out: dict = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key in _BOOL_CONFIG:
            out[key] = True
        elif key.startswith("no_") and key[3:] in _BOOL_CONFIG:
            out[key[3:]] = False
        elif key in _INT_CONFIG or key == "num_gpu_blocks_override":
            if not eq and i + 1 < len(args):
                value = args[i + 1]
            out["num_gpu_blocks" if key == "num_gpu_blocks_override" else key] = value
    return out


def observe_bench(data: dict) -> Observation:
    """A benchmark result (see the module docstring for the keys); missing keys stay unknown."""
    raw = data.get("config") if isinstance(data.get("config"), dict) else None
    if raw is None:
        flags = data.get("server_flags") or data.get("server_args")
        raw = _config_from_flags(flags) if flags else {}

    def pct(*keys: str) -> dict[str, float]:
        for k in keys:
            if isinstance(data.get(k), dict):
                return {p: float(v) for p, v in data[k].items() if p in ("p50", "p95", "p99") and v is not None}
        return {}

    def num(key: str) -> float | None:
        v = data.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    return Observation(source="benchmark result", window_s=num("duration_s"), config=_typed_config(raw),
                       running=num("peak_running"), waiting=num("peak_waiting"), kv_usage=num("peak_kv_usage"),
                       preemptions=num("preemptions"), requests=num("completed"), itl_ms=pct("itl_ms"),
                       ttft_ms=pct("ttft_ms"), queue_ms=pct("queue_ms", "queue_time_ms"),
                       step_tokens=pct("step_tokens"), spec_drafts=num("spec_drafts"),
                       spec_draft_tokens=num("spec_draft_tokens"), spec_accepted_tokens=num("spec_accepted_tokens"))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def observe_from_args(args: argparse.Namespace) -> Observation:
    if args.bench_json:
        with open(args.bench_json) as f:
            return observe_bench(json.load(f))
    if args.snapshot:
        if len(args.snapshot) > 2:
            raise SystemExit("--snapshot takes one file (AFTER) or two (BEFORE AFTER)")
        texts = []
        for path in args.snapshot:
            with open(path) as f:
                texts.append(Scrape.parse(f.read()))
        return observe_scrapes(texts[-1], texts[0] if len(texts) == 2 else None)
    first = Scrape.parse(_scrape(args.url))
    if args.interval <= 0:
        return observe_scrapes(first)
    t0 = time.monotonic()
    time.sleep(args.interval)
    second = Scrape.parse(_scrape(args.url))
    return observe_scrapes(second, first, time.monotonic() - t0)
