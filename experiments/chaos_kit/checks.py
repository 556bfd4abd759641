"""What a chaos run samples while it runs (health every 0.25 s, memory every few seconds) and checks at the end (every
stream against its undisturbed replay, the ledger, the schedulers' logs). Pure functions take plain data."""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.request

import psutil
import redis

from llmserve.processes import health
from scheduler_svc.ledger.store import RedisLedger

HEALTH_LIMIT_S = 1.0  # health must answer (SERVING or not) within this
BEHIND_LINE = "a fail-over promoted a replica that had not received"
# Log lines worth reading after a run: invariant failures, tracebacks, errors.
FINDINGS = re.compile(r"AssertionError|Traceback|invariant|ERROR|CRITICAL")


class HealthSampler:
    """gRPC health of the service address and HTTP /health of the API, every `interval` s, each with a 1 s limit."""

    def __init__(self, grpc_address: str, http_url: str, interval: float = 0.25):
        self.grpc_address, self.http_url, self.interval = grpc_address, http_url, interval
        self.samples: list[dict] = []  # {"t", "grpc", "grpc_s", "http", "http_s"}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            t0 = time.monotonic()
            status = health(self.grpc_address, timeout=HEALTH_LIMIT_S)
            t1 = time.monotonic()
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=HEALTH_LIMIT_S) as r:
                    http = str(r.status)
            except urllib.error.HTTPError as e:
                http = str(e.code)
            except OSError as e:  # a timeout, a refused connection
                http = type(e).__name__
            t2 = time.monotonic()
            self.samples.append({"t": time.time(), "grpc": status, "grpc_s": t1 - t0, "http": http, "http_s": t2 - t1})
            self._stopping.wait(max(0.0, self.interval - (t2 - t0)))

    def stop(self) -> list[dict]:
        self._stopping.set()
        self._thread.join(5)
        return self.samples


def health_summary(samples: list[dict]) -> dict:
    """Late answers (over the limit, or a timeout) and the longest span without SERVING."""
    late = [s for s in samples if s["grpc_s"] > HEALTH_LIMIT_S or s["grpc"] == "DEADLINE_EXCEEDED"
            or s["http_s"] > HEALTH_LIMIT_S or s["http"] in ("TimeoutError", "timeout")]
    longest, since = 0.0, None
    for s in samples:
        if s["grpc"] != "SERVING":
            since = since if since is not None else s["t"]
            longest = max(longest, s["t"] - since)
        else:
            since = None
    return {"samples": len(samples), "late": len(late), "limit_s": HEALTH_LIMIT_S,
            "max_grpc_s": max((s["grpc_s"] for s in samples), default=0.0),
            "max_http_s": max((s["http_s"] for s in samples), default=0.0),
            "not_serving_samples": sum(s["grpc"] != "SERVING" for s in samples),
            "longest_not_serving_s": longest}


class MemorySampler:
    """RSS of every process of the stack (a callable giving name -> pid) and the primary's used_memory."""

    def __init__(self, processes, primary_port, interval: float):
        self.processes, self.primary_port, self.interval = processes, primary_port, interval
        self.samples: list[dict] = []  # {"t", "rss_mib": {name: MiB}, "redis_used_mib"}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            rss, pids = {}, {}
            for name, pid in self.processes().items():
                try:
                    proc = psutil.Process(pid)  # a worker counts with its rank processes
                    rss[name] = (proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(True))) / 2**20
                    pids[name] = pid
                except psutil.Error:
                    pass
            try:
                used = redis.Redis(port=self.primary_port(), socket_timeout=2).info("memory")["used_memory"] / 2**20
            except (redis.RedisError, OSError, ValueError):
                used = None
            self.samples.append({"t": time.time(), "rss_mib": rss, "pids": pids, "redis_used_mib": used})
            self._stopping.wait(self.interval)

    def stop(self) -> list[dict]:
        self._stopping.set()
        self._thread.join(10)
        return self.samples


def memory_growth(samples: list[dict], warmup_s: float, rss_bound_mib: float, redis_bound_mib: float) -> dict:
    """Per process: the median of the last three samples minus the median of the first three after warm-up."""
    if not samples:
        return {"checked": False}
    t0 = samples[0]["t"]
    after = [s for s in samples if s["t"] - t0 >= warmup_s]
    if len(after) < 6:
        return {"checked": False, "reason": f"{len(after)} samples after warm-up (6 needed)"}
    head, tail = after[:3], after[-3:]

    def growth(get) -> float | None:
        a, b = [v for v in map(get, head) if v is not None], [v for v in map(get, tail) if v is not None]
        return statistics.median(b) - statistics.median(a) if a and b else None

    # A process restarted in between (a fault) is a new process: its growth says nothing.
    names = sorted(n for n in set(head[0]["pids"]) & set(tail[-1]["pids"])
                   if all(s["pids"].get(n) == head[0]["pids"][n] for s in (*head, *tail)))
    rss = {n: growth(lambda s, n=n: s["rss_mib"].get(n)) for n in names}
    redis_growth = growth(lambda s: s["redis_used_mib"])
    over = [n for n, g in rss.items() if g is not None and g > rss_bound_mib]
    if redis_growth is not None and redis_growth > redis_bound_mib:
        over.append("redis used_memory")
    return {"checked": True, "warmup_s": warmup_s, "window_s": tail[-1]["t"] - head[0]["t"],
            "rss_growth_mib": rss, "redis_used_growth_mib": redis_growth, "rss_bound_mib": rss_bound_mib,
            "redis_bound_mib": redis_bound_mib, "over_bound": over,
            "rss_end_mib": {n: tail[-1]["rss_mib"][n] for n in names}}


def ledger_state(primary_port: int, namespace: str, timeout: float = 90.0) -> dict:
    """The ledger once idle (no active request, every block free or evictable), or as it is after `timeout`: what
    is still held then is leaked."""
    ledger = RedisLedger(redis.Redis(port=primary_port, socket_timeout=5), namespace=namespace)
    deadline = time.monotonic() + timeout
    while True:
        state = ledger.check_ledger()
        idle = state["free"] + state["evictable"] == state["total"] and not state["active"]
        if idle or time.monotonic() > deadline:
            state["leaked_blocks"] = state["total"] - state["free"] - state["evictable"]
            state["leaked_slots"] = state.get("state_slots", 0) - state.get("state_free", 0)  # hybrid models
            state["leaked_requests"] = state["active"]
            return state
        time.sleep(0.5)


def log_findings(paths: dict[str, str], limit: int = 20) -> dict:
    """Per log: how many times a promoted replica was behind, and the first lines that look like failures."""
    out = {}
    for name, path in paths.items():
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        lines = [line for line in text.splitlines() if FINDINGS.search(line)]
        out[name] = {"behind": text.count(BEHIND_LINE), "findings": len(lines), "first": lines[:limit]}
    return out


def compare(run: list[dict], replay: list[dict]) -> dict:
    """Every stream of the chaos run against the same spec run undisturbed. Lost: ended with an error that is not a
    divergence (or without finishing). Changed: a StreamDiverged, or tokens that differ from the replay."""
    by_index = {r["spec"]["index"]: r for r in replay}
    lost, changed, checked, cancelled, reattached = [], [], 0, 0, 0
    for r in run:
        spec = r["spec"]
        reattached += r["reattaches"] > 0
        if spec["kind"] == "cancel" and not r["error"]:
            cancelled += 1
            continue
        if r["diverged"]:
            changed.append({"index": spec["index"], "kind": spec["kind"], "why": r["error"][:300]})
            continue
        if r["error"] or not all(r["finish"]):
            lost.append({"index": spec["index"], "kind": spec["kind"], "why": r["error"][:300] or "no finish"})
            continue
        ref = by_index.get(spec["index"])
        checked += 1
        if ref is None or ref["error"] or ref["tokens"] != r["tokens"]:
            changed.append({"index": spec["index"], "kind": spec["kind"],
                            "why": "replay failed: " + ref["error"][:200] if ref and ref["error"]
                            else "tokens differ from the undisturbed replay"})
    return {"streams": len(run), "checked": checked, "cancelled": cancelled, "reattached": reattached,
            "lost": lost, "changed": changed,
            "longest_stall_s": max((r["max_gap_s"] for r in run), default=0.0)}


def scrape(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
