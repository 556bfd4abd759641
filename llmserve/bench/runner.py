"""One benchmark run: launch (or reach) a server, warm it up, send a workload, measure, and return the record that
report.py writes as JSON.

Modes of the llmserve stack map to scheduler flags:
  naive      --scheduling-mode naive                 (one request at a time)
  static     --scheduling-mode static                (batches that run to completion before the next is admitted)
  continuous --scheduling-mode continuous --no-enable-chunked-prefill  (a whole prompt per step; the step budget
             is raised to --max-model-len, as it must be without chunking)
  chunked    --scheduling-mode continuous            (chunked prefill on: what `llmserve serve` does by default)
Backends hf-naive, hf-static and hf-continuous run Hugging Face transformers in this process instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import os
import shlex
import sys
import uuid
from dataclasses import asdict, dataclass, field

from common.client import Client
from llmserve import processes
from llmserve.bench import loadgen, metrics, workloads
from llmserve.bench.common import RequestResult, RequestSpec
from protos import llmserve_pb2 as pb

MODE_FLAGS: dict[str, list[str]] = {
    "naive": ["--scheduling-mode", "naive"],
    "static": ["--scheduling-mode", "static"],
    "continuous": ["--scheduling-mode", "continuous", "--no-enable-chunked-prefill"],
    "chunked": ["--scheduling-mode", "continuous"],
}


def server_flags(mode: str, max_model_len: int, extra: list[str]) -> list[str]:
    """The `llmserve serve` flags for a mode: the mode's, --max-model-len, then the user's (last, so they win)."""
    flags = [*MODE_FLAGS[mode], "--max-model-len", str(max_model_len)]
    if mode == "continuous" and not _has_flag(extra, "--max-num-batched-tokens"):
        flags += ["--max-num-batched-tokens", str(max_model_len)]  # without chunking a prompt must fit one step
    return flags + extra


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


class LocalServer:
    """`python -m llmserve.cli serve` in a subprocess (`llmserve.processes.start_serve`): started on free ports, ready
    when it prints its ready line, stopped with SIGTERM. Its output (scheduler, worker and redis-server logs) goes
    to `log_path`."""

    def __init__(self, mode: str, max_model_len: int, extra: list[str], log_path: str, timeout_s: float = 300):
        self.mode = mode
        self.port, self.metrics_port, self.http_port = (processes.free_port() for _ in range(3))
        self.flags = server_flags(mode, max_model_len, extra)
        self.server_args = ["--metrics-port", str(self.metrics_port), *self.flags]
        self.argv = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(self.port), *self.server_args]
        self.log_path, self.timeout_s = log_path, timeout_s
        self.proc: processes.Proc | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def api_pid(self) -> int | None:
        """The pid of `serve`'s HTTP API process (its CPU time is measured per run)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "api" in child.cmdline()[3:4]:  # python -m llmserve.cli api ...
                    return child.pid
        return None

    def __enter__(self) -> LocalServer:
        if os.path.exists(self.log_path):
            os.remove(self.log_path)  # one run per log file
        try:
            self.proc = processes.start_serve(self.server_args, port=self.port, http_port=self.http_port,
                                          timeout=self.timeout_s, log_path=self.log_path)
        except processes.ProcError as e:
            raise RuntimeError(f"`{' '.join(self.argv)}` did not get ready; {e}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            processes.stop(self.proc, timeout=60)


def model_info(address: str, api_key: str | None = None) -> dict:
    async def ask() -> pb.ModelInfoResponse:
        async with Client(address, api_key=api_key) as client:
            return await client.model_info(timeout=10)

    info = asyncio.run(ask())
    return {"model_name": info.model_name, "model_path": info.model_path, "device": info.device, "dtype": info.dtype,
            "max_model_len": info.max_model_len, "block_size": info.block_size, "num_blocks": info.num_blocks,
            "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens}


@dataclass
class Target:
    """Where requests go: a launched LocalServer, an existing server (--target), or an in-process HF backend."""

    backend: str  # llmserve (gRPC) | openai (the HTTP API in front of it) | hf-naive | hf-static | hf-continuous
    mode: str  # the llmserve mode, or the backend name for HF
    address: str | None = None
    metrics_url: str | None = None
    pid: int | None = None  # process tree whose memory is watched
    server_argv: list[str] | None = None
    server_flags: list[str] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    http_url: str | None = None  # openai: the HTTP API's base URL
    api_pid: int | None = None  # openai: the API process, whose CPU time per output token is reported
    text_prompts: bool = False  # openai: send prompts as text (a gateway without token-id prompts: smg)


@dataclass
class RunSettings:
    workload: str
    params: workloads.WorkloadParams
    max_concurrency: int | None = None
    warmup: int = 2
    slo_ms: dict[str, float] = field(default_factory=dict)
    save_requests: bool = False
    progress: bool = True
    api_key: str | None = None
    max_num_seqs: int = 64  # HF backends' batch cap
    model_path: str | None = None  # HF backends
    poll_interval_s: float = 0.1


def _json_number(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def _hf_results(target: Target, specs: list[RequestSpec], s: RunSettings) -> list[RequestResult]:
    from llmserve.bench.hf_backends import run_hf_backend
    from worker_svc.model.loader import default_model_path

    path = s.model_path or default_model_path()
    target.model = target.model or {"model_path": path}
    return run_hf_backend(target.backend, path, specs, s.max_num_seqs, progress=s.progress)


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def prompt_text(target: Target):
    """Token ids -> text with the served model's tokenizer (for a gateway that takes only text prompts)."""
    from common.tokenizer import load_tokenizer
    from worker_svc.model.loader import default_model_path

    tok = load_tokenizer((target.model or {}).get("model_path") or default_model_path())
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


async def _measure_llmserve(target: Target, specs: list[RequestSpec], s: RunSettings, tag: str):
    http = target.backend == "openai"
    transport = (loadgen.HttpTransport(target.http_url, s.api_key, prompt_text(target) if target.text_prompts
                                       else None) if http else loadgen.GrpcTransport(target.address, s.api_key))
    await loadgen.warm_up(transport, s.warmup)
    before = metrics.scrape(target.metrics_url) if target.metrics_url else None
    cpu_before = _cpu_seconds(target.api_pid) if http else None
    with metrics.Watcher(target.metrics_url, target.pid, s.poll_interval_s) as watcher:
        results, reattaches = await loadgen.run(transport, specs, max_concurrency=s.max_concurrency, tag=tag,
                                                progress=s.progress)
    cpu_after = _cpu_seconds(target.api_pid) if http else None
    after = metrics.scrape(target.metrics_url) if target.metrics_url else None
    api_cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return results, reattaches, watcher.peaks, before, after, api_cpu


def run(target: Target, s: RunSettings) -> dict:
    """One run; returns the JSON-ready record (settings, machine, server, metrics, optionally every request)."""
    specs = workloads.generate(s.workload, s.params)
    tag = f"{target.mode}-{uuid.uuid4().hex[:8]}"
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    server: dict = {}
    reattaches = api_cpu = None
    if target.backend in ("llmserve", "openai"):
        if not target.model and target.address:
            target.model = model_info(target.address, s.api_key)
        results, reattaches, peaks, before, after, api_cpu = asyncio.run(_measure_llmserve(target, specs, s, tag))
        if before is not None and after is not None:
            server = metrics.server_deltas(before, after)
    else:
        with metrics.Watcher(None, target.pid or os.getpid(), s.poll_interval_s) as watcher:
            results = _hf_results(target, specs, s)
        peaks = watcher.peaks
    duration = max((r.end_s for r in results if r.end_s is not None), default=0.0)
    summary = metrics.summarize(results, duration, s.slo_ms)
    queue = server.get("queue_time_ms", {})
    hwm = metrics.tree_hwm(target.pid) if target.pid else None
    summary.update({
        "queue_time_ms": queue,
        "queue_time_p95_ms": queue.get("p95"),
        "step_tokens": server.get("step_tokens", {}),
        "preemptions": server.get("preemptions"),
        "reattaches": reattaches,  # streams resumed after UNAVAILABLE (a scheduler restart or lost lease)
        "peak_kv_usage": peaks.kv_usage,
        "peak_running": peaks.running,
        "peak_waiting": peaks.waiting,
        "peak_rss_mb": peaks.rss_bytes / 2**20 if peaks.rss_bytes else None,
        "peak_hwm_mb": hwm / 2**20 if hwm else None,
        # openai: CPU time of the HTTP API process during the run, per output token
        "api_cpu_s": api_cpu,
        "api_cpu_ms_per_output_token": (1000 * api_cpu / summary["total_output_tokens"]
                                        if api_cpu is not None and summary["total_output_tokens"] else None),
    })
    p = workloads.resolved(s.workload, s.params) if s.workload != "trace" else s.params
    record = {
        "command": shlex.join(sys.argv),
        "started_at": started,
        "backend": target.backend,
        "mode": target.mode,
        "workload": {**asdict(p), "name": s.workload, "request_rate": _json_number(p.request_rate)},
        "seed": s.params.seed,
        "request_rate": _json_number(s.params.request_rate),
        "burstiness": s.params.burstiness,
        "max_concurrency": s.max_concurrency,
        "warmup_requests": s.warmup,
        "server": {"address": target.address, "http_url": target.http_url, "metrics_url": target.metrics_url,
                   "argv": target.server_argv,
                   "launched": target.server_argv is not None},
        "server_flags": target.server_flags,  # the key `llmserve diagnose --bench-json` reads
        "machine": {**metrics.machine(), **target.model},
        **summary,  # the metrics at the top level, as `llmserve diagnose --bench-json` reads them
    }
    if s.save_requests:
        record["requests"] = [asdict(r) for r in results]
    return record
