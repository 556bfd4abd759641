"""The peer benchmark's pure core: which servers run which loads, the `vllm bench serve` command line for one load,
the numbers read back from its result JSON, and the table of ratios. Plain data in and out (no processes)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PEERS = ("llmserve", "vllm", "llamacpp")
PEER_LABELS = {"llmserve": "llmserve", "vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}
DTYPES = ("float32", "bfloat16")
# llama.cpp computes on the GGUF's own quantized weights: one run serves as the reference for every dtype row.
GGUF_DTYPE = "gguf"


@dataclass(frozen=True)
class Load:
    """One `vllm bench serve` run: this many prompts, at most `concurrency` in flight."""

    concurrency: int
    num_prompts: int


@dataclass(frozen=True)
class ServerRun:
    """One server start and the loads sent to it before it stops."""

    peer: str  # one of PEERS
    dtype: str  # one of DTYPES, or GGUF_DTYPE for llama.cpp
    loads: tuple[Load, ...]


@dataclass(frozen=True)
class Workload:
    """What each request is (the issue's measurement: random 128-token prompts, 64 output tokens, no early EOS)."""

    input_len: int = 128
    output_len: int = 64
    seed: int = 0


def num_prompts(concurrency: int, per_slot: int, minimum: int, fixed: int | None = None) -> int:
    """Prompts for a load: `fixed` if given, else `per_slot` per concurrency slot (so every slot is refilled a few
    times and the steady state dominates), at least `minimum`."""
    if fixed is not None:
        return fixed
    return max(minimum, per_slot * concurrency)


def build_plan(peers: list[str], dtypes: list[str], concurrencies: list[int], *, per_slot: int, minimum: int,
               fixed: int | None = None) -> list[ServerRun]:
    """Per dtype: llmserve then vLLM (one server each, every concurrency in increasing order); llama.cpp once, last.
    Raises ValueError naming the flag for an unknown peer or dtype, or a concurrency or count below 1."""
    for name, values, allowed in (("--peers", peers, PEERS), ("--dtypes", dtypes, DTYPES)):
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise ValueError(f"{name} must name one or more of {', '.join(allowed)}; got {', '.join(values) or '-'}")
    for name, value in (("--concurrency", min(concurrencies, default=0)), ("--prompts-per-concurrency", per_slot),
                        ("--min-prompts", minimum), ("--num-prompts", 1 if fixed is None else fixed)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    loads = tuple(Load(c, num_prompts(c, per_slot, minimum, fixed)) for c in sorted(set(concurrencies)))
    plan = [ServerRun(peer, dtype, loads) for dtype in dtypes for peer in ("llmserve", "vllm") if peer in peers]
    if "llamacpp" in peers:
        plan.append(ServerRun("llamacpp", GGUF_DTYPE, loads))
    return plan


def bench_serve_argv(vllm_cli: list[str], base_url: str, model: str, tokenizer: str, load: Load, workload: Workload,
                     result_dir: str, result_filename: str) -> list[str]:
    """`vllm bench serve` for one load: streamed `/v1/completions`, random prompts, fixed output length."""
    return [*vllm_cli, "bench", "serve", "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(workload.input_len), "--random-output-len", str(workload.output_len),
            "--ignore-eos", "--num-prompts", str(load.num_prompts), "--max-concurrency", str(load.concurrency),
            "--request-rate", "inf", "--seed", str(workload.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", result_filename]


@dataclass
class Measurement:
    """One load against one server, as read from `vllm bench serve --save-result` (or why there is none)."""

    peer: str
    dtype: str
    concurrency: int
    num_prompts: int
    completed: int = 0
    failed: int = 0
    output_throughput: float | None = None  # output tokens/s
    median_tpot_ms: float | None = None
    median_ttft_ms: float | None = None
    p99_tpot_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_output_tokens: float | None = None  # < the requested length: the server stopped early (EOS not ignored)
    duration_s: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)  # server start-up seconds, argv, log path

    def to_json(self) -> dict:
        return asdict(self)


def parse_result(result: dict, peer: str, dtype: str, load: Load) -> Measurement:
    """The figures of one `vllm bench serve` result JSON."""
    completed = int(result.get("completed") or 0)
    total_out = result.get("total_output_tokens")
    return Measurement(
        peer=peer, dtype=dtype, concurrency=load.concurrency, num_prompts=load.num_prompts, completed=completed,
        failed=int(result.get("failed") or 0), output_throughput=result.get("output_throughput"),
        median_tpot_ms=result.get("median_tpot_ms"), median_ttft_ms=result.get("median_ttft_ms"),
        p99_tpot_ms=result.get("p99_tpot_ms"), p99_ttft_ms=result.get("p99_ttft_ms"),
        mean_output_tokens=total_out / completed if completed and total_out is not None else None,
        duration_s=result.get("duration"))


def _find(measurements: list[Measurement], peer: str, dtype: str, concurrency: int) -> Measurement | None:
    """The measurement of that cell; a completed one before a failed one (tables merged from several runs)."""
    found = [m for m in measurements if m.peer == peer and m.dtype == dtype and m.concurrency == concurrency]
    return min(found, key=lambda m: m.error is not None, default=None)


def _cell(m: Measurement | None, output_len: int) -> str:
    if m is None:
        return "-"
    if m.error is not None or not m.output_throughput:
        return f"failed ({m.error or 'no output'})"[:80]
    text = f"{m.output_throughput:.1f} ({_ms(m.median_tpot_ms)}, {_ms(m.median_ttft_ms)})"
    if m.failed:
        text += f" [{m.failed} failed]"
    if m.mean_output_tokens is not None and m.mean_output_tokens < output_len - 0.5:
        text += f" [{m.mean_output_tokens:.1f} tokens/request]"
    return text


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f} ms"


def _ratio(ours: Measurement | None, theirs: Measurement | None) -> str:
    if ours is None or theirs is None or not ours.output_throughput or not theirs.output_throughput:
        return "-"
    return f"{ours.output_throughput / theirs.output_throughput:.2f}x"


def markdown_table(measurements: list[Measurement], output_len: int) -> str:
    """One row per (dtype, concurrency): each peer's output tokens/s (median TPOT, median TTFT) and the ratios
    llmserve / vLLM (same dtype) and llmserve / llama.cpp (its one GGUF run at that concurrency)."""
    peers = [p for p in PEERS if any(m.peer == p for m in measurements)]
    dtypes = [d for d in DTYPES if any(m.dtype == d for m in measurements)] or [GGUF_DTYPE]
    concurrencies = sorted({m.concurrency for m in measurements})
    head = ["dtype", "concurrency", "prompts"] + [f"{PEER_LABELS[p]} tok/s (median TPOT, TTFT)" for p in peers]
    ratios = [other for other in ("vllm", "llamacpp") if "llmserve" in peers and other in peers]
    head += [f"llmserve / {PEER_LABELS[o]}" for o in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype in dtypes:
        for c in concurrencies:
            row_of = {p: _find(measurements, p, GGUF_DTYPE if p == "llamacpp" else dtype, c) for p in peers}
            present = [m for m in row_of.values() if m is not None]
            if not present:
                continue
            cells = [dtype, str(c), str(max(m.num_prompts for m in present))]
            cells += [_cell(row_of[p], output_len) for p in peers]
            cells += [_ratio(row_of["llmserve"], row_of[o]) for o in ratios]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cpu_per_token(cpu_seconds: dict[str, float], m: Measurement) -> dict[str, float]:
    """Each process's CPU microseconds per output token of one load (empty when the load produced none)."""
    tokens = m.completed * (m.mean_output_tokens or 0)
    if tokens <= 0:
        return {}
    return {name: round(sec / tokens * 1e6, 1) for name, sec in sorted(cpu_seconds.items(), key=lambda kv: -kv[1])
            if sec > 0}


def cpu_table(measurements: list[Measurement]) -> str:
    """CPU time per output token by process for each load that has it: the server's parts (llmserve's `serve` is
    the scheduler's process) and the client, so that the front ends' share can be compared across servers."""
    rows = [m for m in measurements if m.extra.get("cpu_us_per_token")]
    if not rows:
        return ""
    lines = ["", "CPU per output token (us), by process (the client's includes its start-up):", "",
             "| server | dtype | concurrency | total | by process |", "|---|---|---|---|---|"]
    for m in rows:
        cpu = m.extra["cpu_us_per_token"]
        parts = ", ".join(f"{name} {us:,.0f}" for name, us in cpu.items())
        total = sum(us for name, us in cpu.items() if name != "client")
        lines.append(f"| {PEER_LABELS.get(m.peer, m.peer)} | {m.dtype} | {m.concurrency} | {total:,.0f} | {parts} |")
    return "\n".join(lines) + "\n"


# --- Interleaved rounds: both servers up at once, each cell measured in turns, so that a shared box's load (other
# processes starting and stopping) falls on both servers alike instead of on whichever ran at the worse time.

@dataclass(frozen=True)
class Turn:
    """One load of an interleaved run: which server, which load, which round."""

    peer: str
    load: Load
    round: int  # 0-based


def interleaved_turns(peers: list[str], loads: tuple[Load, ...], rounds: int) -> list[Turn]:
    """Per concurrency (increasing), `rounds` rounds of every server; the order flips each round (A B, B A, ...)
    so that a load that rises or falls steadily favours neither. Raises ValueError for rounds < 1."""
    if rounds < 1:
        raise ValueError(f"--interleave-rounds must be >= 1, got {rounds}")
    turns = []
    for load in loads:
        for r in range(rounds):
            order = peers if r % 2 == 0 else list(reversed(peers))
            turns += [Turn(peer, load, r) for peer in order]
    return turns


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None and not math.isnan(v))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _ok(m: Measurement) -> bool:
    return m.error is None and bool(m.output_throughput)


def _load1(m: Measurement) -> str:
    """The 1-minute load average at the load's start and end, `a-b`."""
    start, end = m.extra.get("load_average_start"), m.extra.get("load_average")
    return f"{start[0] if start else '?'}-{end[0] if end else '?'}"


def rounds_table(measurements: list[Measurement]) -> str:
    """For interleaved runs: per (dtype, concurrency), each server's median over rounds of output tok/s, TTFT p50
    and TPOT p50, the llmserve / vLLM ratio of the median tok/s and the ratio within each round (the two loads of a
    round ran back to back, so they saw about the same box); then every load with the box's load average."""
    peers = [p for p in ("llmserve", "vllm") if any(m.peer == p for m in measurements)]
    cells = sorted({(DTYPES.index(m.dtype) if m.dtype in DTYPES else 9, m.dtype, m.concurrency)
                    for m in measurements})
    head = ["dtype", "concurrency", "prompts", "rounds"]
    for p in peers:
        head += [f"{PEER_LABELS[p]} tok/s", f"{PEER_LABELS[p]} TTFT p50", f"{PEER_LABELS[p]} TPOT p50"]
    both = len(peers) == 2
    if both:
        head += ["llmserve / vLLM (medians)", "llmserve / vLLM per round"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, dtype, c in cells:
        mine = [m for m in measurements if m.dtype == dtype and m.concurrency == c]
        by_peer = {p: [m for m in mine if m.peer == p] for p in peers}
        row = [dtype, str(c), str(max(m.num_prompts for m in mine)),
               str(max((m.extra.get("round", 0) for m in mine), default=0) + 1)]
        medians = {}
        for p in peers:
            ok = [m for m in by_peer[p] if _ok(m)]
            medians[p] = _median([m.output_throughput for m in ok])
            failed = len(by_peer[p]) - len(ok)
            tps = "-" if medians[p] is None else f"{medians[p]:.1f}" + (f" [{failed} failed]" if failed else "")
            row += [tps, _ms(_median([m.median_ttft_ms for m in ok])), _ms(_median([m.median_tpot_ms for m in ok]))]
        if both:
            ratio = (f"{medians['llmserve'] / medians['vllm']:.2f}x" if medians["llmserve"] and medians["vllm"]
                     else "-")
            per_round = []
            for r in sorted({m.extra.get("round", 0) for m in mine}):
                pair = {m.peer: m for m in mine if m.extra.get("round", 0) == r}
                per_round.append(_ratio(pair.get("llmserve"), pair.get("vllm")))
            row += [ratio, ", ".join(per_round)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Every load in the order it ran (load average: the 1-minute figure at its start and end):", "",
              "| # | dtype | concurrency | round | server | tok/s | TTFT p50 | TPOT p50 | duration | load average |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for i, m in enumerate(measurements, 1):
        tps = f"{m.output_throughput:.1f}" if _ok(m) else f"failed ({m.error or 'no output'})"[:60]
        duration = "-" if m.duration_s is None else f"{m.duration_s:.0f} s"
        lines.append(f"| {i} | {m.dtype} | {m.concurrency} | {m.extra.get('round', 0) + 1} | "
                     f"{PEER_LABELS.get(m.peer, m.peer)} | {tps} | {_ms(m.median_ttft_ms)} | {_ms(m.median_tpot_ms)} "
                     f"| {duration} | {_load1(m)} |")
    return "\n".join(lines) + "\n"
