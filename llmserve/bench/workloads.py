"""Workload generators: a seed in, a list of `RequestSpec` out, identical on every machine for the same seed.

Prompts are token ids drawn by a seeded `random.Random` from `[TOKEN_LO, TOKEN_HI)`: ordinary vocabulary ids of
the bundled SmolLM2 tokenizer (and of any Llama-family vocabulary of 32k or more), past the special tokens at the
start. Gibberish to the model, but prefill and decode cost the same as for real text, and no tokenizer is needed
to build a workload. Output lengths are fixed per request (sent with `ignore_eos`), so runs compare.

Arrivals: gaps drawn from a gamma distribution with shape = burstiness and mean 1/rate (burstiness 1 = a Poisson
process; below 1 burstier, above 1 more regular); rate inf sends everything at t=0. Each concern draws from its
own seeded stream, so changing the rate does not change the prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace

from llmserve.bench.common import RequestSpec

TOKEN_LO, TOKEN_HI = 1000, 32000
BURST_IDLE_S = 2.0  # the `burst` workload's gap between groups when the rate is inf
WORKLOADS = ("chat", "long-context", "rag", "mixed", "cancel", "burst", "trace")

Range = tuple[int, int]


@dataclass(frozen=True)
class WorkloadParams:
    """The shape knobs. `None` lengths take the workload's default (see DEFAULTS)."""

    num_requests: int = 32
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    prompt_len: Range | None = None  # chat-like prompts; for rag the question after the shared document
    output_len: Range | None = None
    long_prompt_len: Range | None = None  # mixed: the long prompts; rag: the shared documents
    long_share: float = 0.25  # mixed: one request in round(1/long_share) has a long prompt
    cancel_share: float = 0.3  # cancel: share of requests whose client gives up mid-stream
    num_docs: int = 4  # rag: distinct shared documents
    burst_size: int = 8  # burst: requests that arrive at the same instant
    trace_path: str | None = None


# workload -> (prompt_len, output_len, long_prompt_len) defaults, sized for the 135M model on a 2-core CPU.
DEFAULTS: dict[str, tuple[Range, Range, Range | None]] = {
    "chat": ((32, 256), (32, 128), None),
    "long-context": ((2048, 6144), (64, 128), None),
    "rag": ((16, 64), (32, 128), (1024, 1024)),
    "mixed": ((32, 256), (32, 128), (2048, 4096)),
    "cancel": ((32, 256), (32, 128), None),
    "burst": ((32, 256), (32, 128), None),
    "trace": ((0, 0), (0, 0), None),
}


def resolved(name: str, p: WorkloadParams) -> WorkloadParams:
    """`p` with every length range filled in from the workload's defaults (what the JSON report records)."""
    prompt, output, long = DEFAULTS[name]
    return replace(p, prompt_len=p.prompt_len or prompt, output_len=p.output_len or output,
                   long_prompt_len=p.long_prompt_len or long)


def _rng(seed: int, stream: str) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`: stable across processes and Python versions.
    return random.Random(f"{seed}:{stream}")


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choices(range(TOKEN_LO, TOKEN_HI), k=n))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """n arrival offsets: the first at 0, then gamma gaps with shape `burstiness` and mean 1/rate."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = _rng(seed, "arrivals")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def _simple(name: str, p: WorkloadParams) -> list[RequestSpec]:
    """Independent prompts and outputs with lengths uniform in the workload's ranges."""
    rng = _rng(p.seed, name)
    arrivals = arrival_times(p.num_requests, p.request_rate, p.burstiness, p.seed)
    specs = []
    for i in range(p.num_requests):
        prompt = _tokens(rng, rng.randint(*p.prompt_len))
        specs.append(RequestSpec(f"{name}-{i}", prompt, rng.randint(*p.output_len), arrivals[i]))
    return specs


def _rag(p: WorkloadParams) -> list[RequestSpec]:
    """A few long documents shared as prompt prefixes (prefix caching's case), each request with its own question."""
    rng = _rng(p.seed, "rag")
    docs = [_tokens(rng, rng.randint(*p.long_prompt_len)) for _ in range(p.num_docs)]
    arrivals = arrival_times(p.num_requests, p.request_rate, p.burstiness, p.seed)
    specs = []
    for i in range(p.num_requests):
        doc = docs[rng.randrange(p.num_docs)]
        question = _tokens(rng, rng.randint(*p.prompt_len))
        specs.append(RequestSpec(f"rag-{i}", doc + question, rng.randint(*p.output_len), arrivals[i]))
    return specs


def _mixed(p: WorkloadParams) -> list[RequestSpec]:
    """Chat traffic with every k-th request a long prompt: the case chunked prefill exists for."""
    if not 0 < p.long_share <= 1:
        raise ValueError(f"--long-share must be in (0, 1], got {p.long_share}")
    every = max(1, round(1 / p.long_share))
    rng = _rng(p.seed, "mixed")
    arrivals = arrival_times(p.num_requests, p.request_rate, p.burstiness, p.seed)
    specs = []
    for i in range(p.num_requests):
        lengths = p.long_prompt_len if i % every == every - 1 else p.prompt_len
        prompt = _tokens(rng, rng.randint(*lengths))
        specs.append(RequestSpec(f"mixed-{i}", prompt, rng.randint(*p.output_len), arrivals[i]))
    return specs


def _cancel(p: WorkloadParams) -> list[RequestSpec]:
    """Chat traffic where a fixed share of clients cancel after a random number of tokens (up to half)."""
    specs = _simple("cancel", p)
    rng = _rng(p.seed, "cancel-pick")
    chosen = set(rng.sample(range(len(specs)), round(p.cancel_share * len(specs))))
    return [replace(s, cancel_after_tokens=rng.randint(1, max(1, s.max_tokens // 2))) if i in chosen else s
            for i, s in enumerate(specs)]


def _burst(p: WorkloadParams) -> list[RequestSpec]:
    """Groups of `burst_size` requests arriving together; groups arrive at rate/burst_size (the offered request
    rate stays `rate`), or every BURST_IDLE_S seconds when the rate is inf."""
    specs = _simple("burst", p)
    groups = math.ceil(len(specs) / p.burst_size)
    if math.isinf(p.request_rate):
        starts = [g * BURST_IDLE_S for g in range(groups)]
    else:
        starts = arrival_times(groups, p.request_rate / p.burst_size, p.burstiness, p.seed)
    return [replace(s, arrival_s=starts[i // p.burst_size]) for i, s in enumerate(specs)]


def read_trace(path: str, seed: int) -> list[RequestSpec]:
    """JSONL, one request a line: {"prompt_len": int, "output_len": int, "arrival_s": float} and optionally
    "cancel_after_tokens"; prompts are generated from the seed, the arrival times are the file's."""
    rng = _rng(seed, "trace")
    specs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            specs.append(RequestSpec(f"trace-{len(specs)}", _tokens(rng, int(row["prompt_len"])),
                                     int(row["output_len"]), float(row["arrival_s"]),
                                     row.get("cancel_after_tokens")))
    return specs


def write_trace(path: str, specs: list[RequestSpec]) -> None:
    """The inverse of read_trace's shape: lengths and arrival times, one JSON object per line."""
    with open(path, "w") as f:
        for s in specs:
            row = {"prompt_len": len(s.prompt_ids), "output_len": s.max_tokens, "arrival_s": s.arrival_s}
            if s.cancel_after_tokens is not None:
                row["cancel_after_tokens"] = s.cancel_after_tokens
            f.write(json.dumps(row) + "\n")


def generate(name: str, params: WorkloadParams) -> list[RequestSpec]:
    """The requests of workload `name` for `params` (same params -> the same list, on any machine)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if name == "trace":
        if not params.trace_path:
            raise ValueError("the trace workload needs a JSONL file (--trace FILE)")
        specs = read_trace(params.trace_path, params.seed)
        return specs[: params.num_requests] if params.num_requests else specs
    p = resolved(name, params)
    for label, (lo, hi) in (("prompt", p.prompt_len), ("output", p.output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{label} length range must be 1 <= lo <= hi, got {lo}-{hi}")
    if name == "rag":
        if p.num_docs < 1:
            raise ValueError(f"--num-docs must be >= 1, got {p.num_docs}")
        return _rag(p)
    if name == "mixed":
        return _mixed(p)
    if name == "cancel":
        return _cancel(p)
    if name == "burst":
        return _burst(p)
    return _simple(name, p)


def parse_range(text: str) -> Range:
    """'64' -> (64, 64); '32:256' or '32-256' -> (32, 256)."""
    parts = text.replace("-", ":").split(":")
    lo, hi = int(parts[0]), int(parts[-1])
    if len(parts) > 2 or lo > hi:
        raise ValueError(f"expected N or LO:HI with LO <= HI, got {text!r}")
    return lo, hi
