"""`llmserve diagnose`: which of three limits holds a deployment back, the numbers that show it, the flag to change.

- kv-capacity: the KV pool is too small for the load (preemptions, usage near 100%, the queue grows).
- batch-admission: `--max-num-seqs` or the token budget (`--max-num-batched-tokens`) keeps requests waiting while
  the KV pool still has room.
- prefill-interference: inter-token latency spikes when long prompts arrive, because chunking is off or the
  budget lets one step carry far more prefill than a decode step computes.
- speculative-decoding: with --speculative-config, few drafts are accepted while the batch is busy, so the draft
  rows the forward verifies cost more compute than the tokens they save (at low load they are nearly free).

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
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# ---- thresholds ----------------------------------------------------------------------------------------------------

# KV usage at or above this is "full": the free blocks left are what the running requests' next tokens take, so a
# waiting request cannot be admitted without preempting one.
KV_HIGH = 0.9
# Below this the pool clearly has room for more sequences (the gauge-only rule for batch admission).
KV_FREE = 0.7
# Requests must have waited after at least this share of steps: a queue seen in fewer steps is a burst being
# absorbed, not a limit.
QUEUED_SHARE = 0.2
# A limit must account for at least this share of the steps that left requests waiting to be named the cause.
DOMINANT_SHARE = 0.5
# ITL p99 / p50 at or above this is a prefill tail: a step that carries a full budget of prefill next to the decodes
# costs several decode steps, while batch-size drift and scheduling jitter move ITL by well under 5x.
ITL_TAIL_RATIO = 5.0
# Step sizes (tokens) whose p99 is this many times the p50 mean some steps carry much more than the usual decode
# batch: that is where the ITL tail comes from. It is also the step size, in decode batches, we suggest capping at.
STEP_TAIL_RATIO = 4.0
# Speculative decoding costs more than it gains when under this share of draft tokens is accepted while the batch is
# busy: every draft is one more query row of the forward, which is nearly free while a step is bound by reading the
# weights (few sequences) and costs its share of compute once many sequences fill the step.
SPEC_LOW_ACCEPTANCE = 0.3
SPEC_BUSY_SEQS = 16  # running sequences from which a step counts as busy

LIMITS = ("kv-capacity", "batch-admission", "prefill-interference", "speculative-decoding", "none")
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


# ---- the verdict ---------------------------------------------------------------------------------------------------

@dataclass
class Suggestion:
    flag: str
    value: str  # "" for a switch such as --enable-chunked-prefill
    reason: str

    def __str__(self) -> str:
        return f"{self.flag} {self.value}".rstrip() + f"   ({self.reason})"


@dataclass
class Finding:
    limiter: str
    evidence: list[str]
    suggestions: list[Suggestion]


@dataclass
class Verdict:
    limiter: str  # one of LIMITS
    evidence: list[str]
    suggestions: list[Suggestion]
    also: list[Finding]  # further limits that hold, weaker than the first
    numbers: list[str]  # the measurements, whatever the verdict
    source: str


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _pow2_ceil(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _queued_steps(obs: Observation) -> tuple[float, float] | None:
    """(steps that left requests waiting, all steps) when the server exports the admission counters."""
    if not obs.blocked or not obs.steps:
        return None
    return sum(obs.blocked.values()), obs.steps


def _kv_capacity(obs: Observation) -> Finding | None:
    evidence = []
    if obs.preemptions:
        per = f", {100 * obs.preemptions / obs.requests:.0f} per 100 finished requests" if obs.requests else ""
        evidence.append(f"{obs.preemptions:.0f} preemptions (recompute: the pool ran out of blocks){per}")
    queued = _queued_steps(obs)
    kv_share = obs.blocked.get("kv_cache", 0) / queued[0] if queued and queued[0] else 0.0
    if queued and queued[0] / queued[1] >= QUEUED_SHARE and kv_share >= DOMINANT_SHARE:
        evidence.append(f"requests waited after {_pct(queued[0] / queued[1])} of {queued[1]:.0f} steps; free KV "
                        f"blocks were the limit in {_pct(kv_share)} of them")
    if obs.kv_usage is not None and obs.kv_usage >= KV_HIGH and obs.waiting:
        if obs.waiting_before is None:
            evidence.append(f"KV usage {_pct(obs.kv_usage)} with {obs.waiting:.0f} requests waiting")
        elif obs.waiting > obs.waiting_before:
            evidence.append(f"KV usage {_pct(obs.kv_usage)} while the queue grew "
                            f"{obs.waiting_before:.0f} -> {obs.waiting:.0f}")
    if not evidence:
        return None
    cfg = obs.config
    blocks, per_block = cfg.get("num_gpu_blocks"), cfg.get("kv_bytes_per_block")
    # Doubling: the demand behind the preemptions is not in the metrics; twice the pool is the step that reliably
    # ends them for a steady load. Re-run diagnose after the change.
    target = 2 * blocks if blocks else None
    pool = "pool size unknown"
    if blocks:
        pool = f"the pool is {blocks} blocks" + (f" of {cfg['block_size']} tokens" if cfg.get("block_size") else "")
    suggestions = []
    if str(cfg.get("device", "")).startswith("cuda"):
        suggestions.append(Suggestion("--gpu-memory-utilization", "0.95", f"{pool}; more GPU memory for the KV pool"))
    elif blocks and per_block:
        suggestions.append(Suggestion("--kv-cache-memory", str(target * per_block),
                                      f"{pool} = {blocks * per_block / 2**20:.0f} MiB; double it"))
    suggestions.append(Suggestion("--num-gpu-blocks-override", str(target) if target else "(larger)",
                                  f"{pool}; double it; this flag wins over the memory flags when set"))
    return Finding("kv-capacity", evidence, suggestions)


def _more_seqs(obs: Observation, max_seqs: int) -> int:
    """Twice the cap, or less when the KV each running request holds would push the pool past KV_HIGH."""
    target = 2 * max_seqs
    if obs.kv_usage and obs.running:
        target = min(target, int(KV_HIGH * obs.running / obs.kv_usage))
    return max(target, max_seqs + 1)


def _batch_admission(obs: Observation) -> Finding | None:
    cfg = obs.config
    max_seqs, budget = cfg.get("max_num_seqs"), cfg.get("max_num_batched_tokens")
    kv = f"KV usage peak {_pct(obs.kv_usage)}" if obs.kv_usage is not None else "KV usage unknown"
    queued = _queued_steps(obs)
    if queued:
        if queued[0] / queued[1] < QUEUED_SHARE or (obs.kv_usage is not None and obs.kv_usage >= KV_HIGH):
            return None
        limit = max(("max_num_seqs", "token_budget"), key=lambda k: obs.blocked.get(k, 0))
        share = obs.blocked.get(limit, 0) / queued[0]
        if share < DOMINANT_SHARE:
            return None
        evidence = [f"requests waited after {_pct(queued[0] / queued[1])} of {queued[1]:.0f} steps; "
                    f"{'max-num-seqs' if limit == 'max_num_seqs' else 'the token budget'} was the limit in "
                    f"{_pct(share)} of them", kv]
    elif (max_seqs and obs.running is not None and obs.running >= max_seqs and obs.waiting
          and obs.kv_usage is not None and obs.kv_usage < KV_FREE):
        limit = "max_num_seqs"  # gauges only (no admission counters): the running batch sits at the cap
        evidence = [f"{obs.running:.0f} running = max-num-seqs with {obs.waiting:.0f} waiting", kv]
    else:
        return None
    if obs.queue_ms:
        evidence.append(f"queue time p50 {obs.queue_ms.get('p50', 0):.0f} ms, p99 {obs.queue_ms.get('p99', 0):.0f} ms")
    if limit == "max_num_seqs":
        evidence.insert(1, f"max-num-seqs {max_seqs}" if max_seqs else "max-num-seqs unknown")
        value = str(_more_seqs(obs, max_seqs)) if max_seqs else "(larger)"
        return Finding("batch-admission", evidence,
                       [Suggestion("--max-num-seqs", value, "more requests per batch; KV has room for them")])
    p50, p99 = obs.itl_ms.get("p50"), obs.itl_ms.get("p99")
    if p50 and p99 is not None and p99 / p50 >= ITL_TAIL_RATIO:
        return None  # the budget already buys the ITL bound: a larger one lengthens the steps that make the tail
    evidence.insert(1, f"token budget {budget} tokens per step" if budget else "token budget unknown")
    value = str(2 * budget) if budget else "(larger)"
    return Finding("batch-admission", evidence, [Suggestion(
        "--max-num-batched-tokens", value, "admit more prefill per step; a larger budget lengthens prefill steps, "
        "so watch ITL p99")])


def _prefill_interference(obs: Observation) -> Finding | None:
    p50, p99 = obs.itl_ms.get("p50"), obs.itl_ms.get("p99")
    if not p50 or p99 is None or p99 / p50 < ITL_TAIL_RATIO:
        return None
    if obs.prompt_tokens == 0:
        return None  # no prefill in the window: the tail comes from elsewhere
    evidence = [f"ITL p50 {p50:.1f} ms, p99 {p99:.1f} ms ({p99 / p50:.1f}x, threshold {ITL_TAIL_RATIO:g}x)"]
    s50, s99 = obs.step_tokens.get("p50"), obs.step_tokens.get("p99")
    if s50 and s99 is not None:
        if s99 / s50 < STEP_TAIL_RATIO:
            return None  # every step is about the same size: prefill does not make the slow ones
        evidence.append(f"tokens per step p50 {s50:.0f}, p99 {s99:.0f}: some steps carry long prefills")
    cfg = obs.config
    chunked, budget = cfg.get("enable_chunked_prefill"), cfg.get("max_num_batched_tokens")
    # Cap a step at STEP_TAIL_RATIO decode batches (at least max-num-seqs, which one decode step may need).
    decode = s50 or obs.running
    target = max(_pow2_ceil(STEP_TAIL_RATIO * decode), cfg.get("max_num_seqs") or 1) if decode else None
    if budget and not target:
        target = budget // 2
    suggestions = []
    if chunked is False:
        evidence.append("chunked prefill is off: a prompt is prefilled whole in one step")
        suggestions.append(Suggestion("--enable-chunked-prefill", "", "split long prompts across steps"))
    elif budget and target and budget <= target:
        return None  # steps are already capped near the decode batch: not a budget problem
    if budget:
        evidence.append(f"token budget {budget} tokens per step" + (f" (suggested {target})" if target else ""))
    if target and (not budget or target < budget):
        suggestions.append(Suggestion("--max-num-batched-tokens", str(target),
                                      f"caps a step at about {STEP_TAIL_RATIO:g}x a decode batch, bounding the tail"))
    return Finding("prefill-interference", evidence, suggestions)


def _spec_acceptance(obs: Observation) -> float | None:
    if not obs.spec_draft_tokens or obs.spec_accepted_tokens is None:
        return None
    return obs.spec_accepted_tokens / obs.spec_draft_tokens


def _speculation(obs: Observation) -> Finding | None:
    """Low draft acceptance while many sequences run: the verification rows cost more than they save."""
    rate = _spec_acceptance(obs)
    if rate is None or rate >= SPEC_LOW_ACCEPTANCE:
        return None
    busy = obs.running is not None and obs.running >= SPEC_BUSY_SEQS
    budget = obs.config.get("max_num_batched_tokens")
    full_steps = bool(budget and obs.step_tokens.get("p50", 0) >= budget / 2)
    if not (busy or full_steps):
        return None
    k = obs.config.get("num_speculative_tokens")
    evidence = [f"{_pct(rate)} of {obs.spec_draft_tokens:.0f} draft tokens accepted (below "
                f"{_pct(SPEC_LOW_ACCEPTANCE)})"]
    if busy:
        evidence.append(f"{obs.running:.0f} sequences running: each draft is a query row the busy forward computes")
    if full_steps:
        evidence.append(f"tokens per step p50 {obs.step_tokens['p50']:.0f} of a {budget}-token budget: drafts take "
                        "budget from other requests")
    suggestions = [Suggestion("--speculative-config", "(drop it)", "plain decoding is cheaper for this load")]
    if k and k > 1:
        suggestions.append(Suggestion("--speculative-config", f'\'{{"method": "ngram", "num_speculative_tokens": '
                                      f'{max(1, k // 2)}}}\'', "fewer drafts per step waste less when most fail"))
    return Finding("speculative-decoding", evidence, suggestions)


def _numbers(obs: Observation) -> list[str]:
    out = [f"source: {obs.source}"]

    def add(label: str, v, fmt: str = "{:.0f}") -> None:
        if v is not None:
            out.append(f"{label}: {fmt.format(v)}")

    add("finished requests", obs.requests)
    add("steps", obs.steps)
    add("running", obs.running)
    if obs.waiting_before is not None and obs.waiting is not None:
        out.append(f"waiting: {obs.waiting_before:.0f} -> {obs.waiting:.0f}")
    else:
        add("waiting", obs.waiting)
    if obs.kv_usage is not None:
        out.append(f"KV usage peak: {_pct(obs.kv_usage)}")
    add("preemptions", obs.preemptions)
    if obs.blocked:
        out.append("steps that left requests waiting, by limit: "
                   + ", ".join(f"{k} {v:.0f}" for k, v in obs.blocked.items()))
    for label, d, unit in (("ITL", obs.itl_ms, " ms"), ("TTFT", obs.ttft_ms, " ms"),
                           ("queue time", obs.queue_ms, " ms"), ("tokens per step", obs.step_tokens, "")):
        if d:
            out.append(f"{label}: " + ", ".join(f"{k} {v:.1f}{unit}" for k, v in d.items()))
    rate = _spec_acceptance(obs)
    if rate is not None:
        runs = f", {obs.spec_accepted_tokens / obs.spec_drafts:.2f} accepted per draft run" if obs.spec_drafts else ""
        out.append(f"speculative decoding: {_pct(rate)} of {obs.spec_draft_tokens:.0f} draft tokens accepted{runs}")
    if obs.config:
        out.append("config: " + ", ".join(f"{k}={v}" for k, v in obs.config.items()))
    return out


def diagnose(obs: Observation) -> Verdict:
    """The first limit that holds, in order of cost: a short pool (preemptions redo work), then admission, then
    the latency tail; the rest go to `also`."""
    findings = [f for f in (_kv_capacity(obs), _batch_admission(obs), _prefill_interference(obs),
                            _speculation(obs)) if f]
    numbers = _numbers(obs)
    if not findings:
        return Verdict("none", ["no preemptions, no queue held back by a limit, no prefill-driven ITL tail"], [], [],
                       numbers, obs.source)
    first, *rest = findings
    return Verdict(first.limiter, first.evidence, first.suggestions, rest, numbers, obs.source)


def format_report(v: Verdict) -> str:
    lines = [f"limiter: {v.limiter}"]
    lines += [f"  - {e}" for e in v.evidence]
    if v.suggestions:
        lines.append("change:")
        lines += [f"  {s}" for s in v.suggestions]
    for f in v.also:
        lines.append(f"also {f.limiter}:")
        lines += [f"  - {e}" for e in f.evidence]
        lines += [f"  change: {s}" for s in f.suggestions]
    lines.append("numbers:")
    lines += [f"  {n}" for n in v.numbers]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------------------------

def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a scheduler's metrics endpoint, e.g. http://127.0.0.1:9090/metrics")
    src.add_argument("--snapshot", nargs="+", metavar="FILE", help="saved metrics text: AFTER, or BEFORE AFTER")
    src.add_argument("--bench-json", metavar="FILE", help="a benchmark result JSON (`llmserve bench serve`)")
    p.add_argument("--interval", type=float, default=10.0,
                   help="seconds between the two scrapes of --url; 0 scrapes once (totals since start)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")


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


def main(args: argparse.Namespace) -> None:
    try:
        obs = observe_from_args(args)
    except (OSError, ValueError) as e:  # unreachable URL, missing file, bad JSON or metrics text
        print(f"llmserve diagnose: cannot read the input: {e}", file=sys.stderr)
        sys.exit(2)
    verdict = diagnose(obs)
    print(json.dumps(asdict(verdict), indent=2) if args.json else format_report(verdict))
