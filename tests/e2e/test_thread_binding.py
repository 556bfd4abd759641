"""--cpu-omp-threads-bind on a real worker process: thread i of the model's team runs on core i of the list, gRPC's
threads keep every core, and a list that does not fit the ranks is refused at start naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = sorted(os.sched_getaffinity(0))


def thread_cores(pid: int) -> dict[int, list[int]]:
    """Each thread of process `pid`: the cores it may run on."""
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def test_each_model_thread_runs_on_its_core_and_grpc_threads_keep_all():
    cores = list(reversed(ALLOWED))  # thread 0 (the one that runs the steps) on the last core: not the default order
    worker = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", 64,
                                   "--cpu-omp-threads-bind", ",".join(map(str, cores))])
    try:
        threads = thread_cores(worker.pid)
        assert threads[worker.pid] == [cores[0]]  # the main thread runs the steps: the team's thread 0
        pinned = sorted(c[0] for c in threads.values() if len(c) == 1)
        assert pinned == sorted(cores)  # one thread per core of the list
        if len(ALLOWED) > 1:
            assert ALLOWED in threads.values()  # gRPC's threads started before the binding
        assert "model threads pinned to cores" in worker.log_text()
    finally:
        cluster.stop(worker)


@pytest.mark.parametrize("value,needles", [
    ("0|0", ["--cpu-omp-threads-bind", "names 2 core list(s) for the 1 tensor-parallel rank(s)"]),
    ("3-1", ["--cpu-omp-threads-bind", "0-3|4-7"]),
    (str(max(ALLOWED) + 1), ["--cpu-omp-threads-bind", f"cores [{max(ALLOWED) + 1}] are not among"]),
])
def test_a_list_that_does_not_fit_is_refused_at_start(value, needles):
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "worker", "--port", "0", "--device", "cpu",
                          "--cpu-omp-threads-bind", value], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    for n in needles:
        assert n in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
