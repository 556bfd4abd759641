"""`llmserve diagnose`: which of three limits holds a deployment back, the numbers that show it, the flag to change.

- kv-capacity: the KV pool is too small for the load (preemptions, usage near 100%, the queue grows).
- batch-admission: `--max-num-seqs` or the token budget (`--max-num-batched-tokens`) keeps requests waiting while
  the KV pool still has room.
- prefill-interference: inter-token latency spikes when long prompts arrive, because chunking is off or the
  budget lets one step carry far more prefill than a decode step computes.
- speculative-decoding: with --speculative-config, the tokens accepted drafts add per step are worth less than
  the step-time increase their verification rows cost at the current load (nearly free at low load, their full
  share of compute once many sequences fill the step).

The inputs (metrics, saved scrapes, a benchmark JSON) are read into one Observation by llmserve/observation.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from llmserve.observation import Observation, observe_from_args

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
# Speculative decoding: a request that verifies d drafts per step and has a accepted emits 1 + a tokens for a step
# that computes 1 + d query rows. Extra rows are nearly free while a step is bound by reading the weights (few
# sequences) and cost their full share of compute once the step is compute-bound; the share in between grows with the
# running sequences up to SPEC_COMPUTE_BOUND_SEQS (a decode batch that fills a GPU's compute; vLLM measured up to
# 1.8x slowdowns at high QPS). Estimated speedup = (1 + a) / (1 + load * d); below 1 it costs more than it gains.
# A draft model's own forwards come on top of that (the estimate is the best case for it).
SPEC_COMPUTE_BOUND_SEQS = 64
SPEC_BUSY_SEQS = 16  # running sequences from which a step counts as busy

LIMITS = ("kv-capacity", "batch-admission", "prefill-interference", "speculative-decoding", "none")


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


def spec_speedup(obs: Observation) -> tuple[float, float, float] | None:
    """(estimated speedup, step-time increase, load share) of speculation at the observed load; None without
    drafts. See SPEC_COMPUTE_BOUND_SEQS."""
    if not obs.spec_draft_tokens or obs.spec_accepted_tokens is None or not obs.spec_drafts:
        return None
    per_run_drafts = obs.spec_draft_tokens / obs.spec_drafts
    per_run_accepted = obs.spec_accepted_tokens / obs.spec_drafts
    load = min(1.0, (obs.running or 1) / SPEC_COMPUTE_BOUND_SEQS)
    budget = obs.config.get("max_num_batched_tokens")
    if budget and obs.step_tokens.get("p50", 0) >= budget / 2:
        load = 1.0  # steps full of tokens: drafts take budget (and compute) from other requests
    increase = load * per_run_drafts
    return (1 + per_run_accepted) / (1 + increase), increase, load


def _speculation(obs: Observation) -> Finding | None:
    """Speculation that costs more than it gains: the accepted tokens per step against the step-time increase the
    verification rows cost at this load."""
    rate, estimate = _spec_acceptance(obs), spec_speedup(obs)
    if rate is None or estimate is None or estimate[0] >= 1.0:
        return None
    speedup, increase, load = estimate
    busy = obs.running is not None and obs.running >= SPEC_BUSY_SEQS
    budget = obs.config.get("max_num_batched_tokens")
    full_steps = bool(budget and obs.step_tokens.get("p50", 0) >= budget / 2)
    k = obs.config.get("num_speculative_tokens")
    evidence = [f"{_pct(rate)} of {obs.spec_draft_tokens:.0f} draft tokens accepted: "
                f"{1 + obs.spec_accepted_tokens / obs.spec_drafts:.2f} tokens per request-step for an estimated "
                f"{_pct(increase)} longer step at this load ({_pct(load)} compute-bound): about {speedup:.2f}x"]
    if busy:
        evidence.append(f"{obs.running:.0f} sequences running: each draft is a query row the busy forward computes")
    if full_steps:
        evidence.append(f"tokens per step p50 {obs.step_tokens['p50']:.0f} of a {budget}-token budget: drafts take "
                        "budget from other requests")
    suggestions = [Suggestion("--speculative-config", "(drop it)", "plain decoding is cheaper for this load")]
    if k and k > 1:
        fewer = f'\'{{..., "num_speculative_tokens": {max(1, k // 2)}}}\''
        suggestions.append(Suggestion("--speculative-config", fewer, "fewer drafts per step waste less when most fail"))
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
        if (estimate := spec_speedup(obs)) is not None:
            out.append(f"speculation estimate at this load: {estimate[0]:.2f}x (step time +{_pct(estimate[1])})")
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


def main(args: argparse.Namespace) -> None:
    try:
        obs = observe_from_args(args)
    except (OSError, ValueError) as e:  # unreachable URL, missing file, bad JSON or metrics text
        print(f"llmserve diagnose: cannot read the input: {e}", file=sys.stderr)
        sys.exit(2)
    verdict = diagnose(obs)
    print(json.dumps(asdict(verdict), indent=2) if args.json else format_report(verdict))
