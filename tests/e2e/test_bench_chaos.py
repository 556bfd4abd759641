"""experiments/chaos.py in a smoke size: one kill -9 of the Redis primary, one SIGSTOP of it, one of the leading
scheduler and one of the worker under 4 mixed streams, with `none` durability; then the undisturbed replay. The
report has its structure and every check ran; nothing leaked; the scheduler and worker kills lost no stream (those
paths are lossless). Losses around a Redis fail-over are reported, not asserted here (issue 50: a Redis error
during fail-over can still end a stream UNKNOWN)."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_runs import run_bench

pytestmark = pytest.mark.slow


def test_chaos_smoke(tmp_path):
    out = tmp_path / "chaos.json"
    stdout = run_bench("chaos", "--primary-kills", 1, "--primary-stops", 1, "--scheduler-kills", 1, "--worker-kills",
                       1, "--concurrency", 4, "--durability", "none", "--max-tokens", 16, "--gap-s", 3,
                       "--warmup-s", 3, "--json", out, timeout=900)
    report = json.loads(out.read_text())
    (mode,) = report["modes"]
    assert mode["mode"] == "none" and "| none |" in stdout
    assert mode["fault_counts"] == {"primary-kill": 1, "primary-stop": 1, "scheduler-kill": 1, "worker-kill": 1}
    assert mode["fault_errors"] == 0, mode["faults"]
    # The next fault came only after tokens reached a client again (not merely health SERVING).
    assert all(f["progress_s"] is not None and f["progress_s"] >= f["recovered_s"] for f in mode["faults"]), \
        mode["faults"]
    assert [f["kind"] for f in mode["faults"]] == [f["kind"] for f in sorted(mode["faults"], key=lambda f: f["n"])]
    # Every check ran: each stream was compared (or cancelled, or counted lost), the ledger read, health sampled.
    assert mode["streams"] >= 4 and mode["replayed"] >= 1
    assert mode["checked"] + mode["cancelled"] + len(mode["lost"]) + len(mode["changed"]) == mode["streams"]
    assert mode["health"]["samples"] > 0 and mode["ledger_after_run"]["total"] == 512
    assert mode["leaked"] == 0 and mode["ledger_end"]["leaked_blocks"] == 0, mode["ledger_end"]
    # A stream in flight during a scheduler or worker kill re-attaches and completes: a lost one must overlap a
    # Redis fault (kill or partition of the primary).
    redis_faults = [(f["at"], f["at"] + f["recovered_s"]) for f in mode["faults"] if f["kind"].startswith("primary")]
    lost = {x["index"] for x in mode["lost"]}
    for s in mode["streams_detail"]:
        if s["spec"]["index"] in lost:
            assert any(s["start"] <= end and start <= s["end"] for start, end in redis_faults), \
                f"stream {s['spec']['index']} lost outside a Redis fault: {s['error']}"
