"""Reports: one JSON file per run, a Markdown table across runs, and PNG plots of a sweep (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os
import re


def run_label(record: dict) -> str:
    """'chunked' for the llmserve stack over gRPC, 'chunked-http' through its OpenAI API, 'hf-static' for a
    baseline."""
    if record["backend"] == "openai":
        return f"{record['mode']}-http"
    return record["mode"] if record["backend"] == "llmserve" else record["backend"]


def rate_value(record: dict) -> float:
    rate = record["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def write_json(record: dict, result_dir: str) -> str:
    """Write `record` as <label>_<workload>_rate<R>_<time>.json under result_dir; returns the path."""
    os.makedirs(result_dir, exist_ok=True)
    stamp = re.sub(r"[^0-9T]", "", record["started_at"])[:15]
    name = f"{run_label(record)}_{record['workload']['name']}_rate{record['request_rate']}_{stamp}"
    path = os.path.join(result_dir, name + ".json")
    n = 1
    while os.path.exists(path):  # two runs within the same second
        n += 1
        path = os.path.join(result_dir, f"{name}_{n}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return path


def fmt(x: float | int | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    """a / b as '1.23x'; '-' when either is missing or zero."""
    return "-" if not a or not b else f"{a / b:.2f}x"


COLUMNS = ("run", "workload", "rate", "ok/failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50",
           "ITL p99", "TPOT p50", "e2e p50", "goodput", "preempt", "peak KV", "peak RSS MB")


def markdown_table(records: list[dict]) -> str:
    """One row per run; latencies in ms, goodput in requests/s, peak KV as a percentage of the pool."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        m = r
        kv = m["peak_kv_usage"]
        row = [run_label(r), r["workload"]["name"], str(r["request_rate"]),
               f"{m['completed'] + m['cancelled']}/{m['failed']}", fmt(m["request_throughput"], 2),
               fmt(m["output_throughput"]), fmt(m["ttft_ms"]["p50"]), fmt(m["ttft_ms"]["p99"]),
               fmt(m["itl_ms"]["p50"]), fmt(m["itl_ms"]["p99"]), fmt(m["tpot_ms"]["p50"]), fmt(m["e2e_ms"]["p50"]),
               fmt(m["goodput"], 2), fmt(m["preemptions"]), "-" if kv is None else f"{100 * kv:.0f}%",
               fmt(m["peak_rss_mb"], 0)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(records: list[dict], result_dir: str, prefix: str = "sweep") -> list[str]:
    """Two PNGs: latency percentiles (TTFT p50, TTFT p99, ITL p99) and output throughput against the offered
    request rate, one line per mode. The rates are evenly spaced categories so 'inf' (all at once) has a place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(result_dir, exist_ok=True)
    rates = sorted({rate_value(r) for r in records})
    xs = {rate: i for i, rate in enumerate(rates)}
    ticks = ["inf" if math.isinf(x) else f"{x:g}" for x in rates]
    by_label: dict[str, list[dict]] = {}
    for r in sorted(records, key=rate_value):
        by_label.setdefault(run_label(r), []).append(r)

    def series(runs: list[dict], pick) -> tuple[list[int], list[float]]:
        points = [(xs[rate_value(r)], pick(r)) for r in runs]
        points = [(x, y) for x, y in points if y is not None]
        return [x for x, _ in points], [y for _, y in points]

    panels = (("TTFT p50 (ms)", lambda m: m["ttft_ms"]["p50"]), ("TTFT p99 (ms)", lambda m: m["ttft_ms"]["p99"]),
              ("ITL p99 (ms)", lambda m: m["itl_ms"]["p99"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), constrained_layout=True)
    for ax, (title, pick) in zip(axes, panels, strict=True):
        for label, runs in by_label.items():
            ax.plot(*series(runs, pick), marker="o", label=label)
        ax.set(title=title, xlabel="offered request rate (req/s)", xticks=range(len(rates)), xticklabels=ticks)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    latency_path = os.path.join(result_dir, f"{prefix}_latency.png")
    fig.savefig(latency_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for label, runs in by_label.items():
        ax.plot(*series(runs, lambda m: m["output_throughput"]), marker="o", label=label)
    ax.set(title="output throughput", xlabel="offered request rate (req/s)", ylabel="output tokens/s",
           xticks=range(len(rates)), xticklabels=ticks)
    ax.grid(True, alpha=0.3)
    ax.legend()
    throughput_path = os.path.join(result_dir, f"{prefix}_throughput.png")
    fig.savefig(throughput_path, dpi=100)
    plt.close(fig)
    return [latency_path, throughput_path]


def http_vs_grpc(grpc_run: dict, http_run: dict) -> str:
    """What the HTTP layer adds on the same workload and server: TTFT and ITL p50 (HTTP minus gRPC), output
    tokens/s (HTTP / gRPC) and the API process's CPU time per output token."""

    def diff(key: str) -> str:
        a, b = grpc_run[key]["p50"], http_run[key]["p50"]
        return "-" if a is None or b is None else f"{b - a:+.2f}"

    ratio = (http_run["output_throughput"] / grpc_run["output_throughput"]
             if http_run["output_throughput"] and grpc_run["output_throughput"] else None)
    rows = [("TTFT p50 added by HTTP (ms)", diff("ttft_ms")), ("ITL p50 added by HTTP (ms)", diff("itl_ms")),
            ("output tokens/s, HTTP / gRPC", "-" if ratio is None else f"{ratio:.3f}"),
            ("API process CPU per output token (ms)", fmt(http_run.get("api_cpu_ms_per_output_token"), 3))]
    title = "HTTP vs gRPC" if http_run.get("mode") != "smg" else "smg gateway (HTTP) vs gRPC"
    return f"| {title} | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
