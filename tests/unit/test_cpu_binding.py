"""--cpu-omp-threads-bind: the core lists each rank binds to, and the refusals that name the flag."""

import os
import subprocess
import sys

import pytest

from worker_svc.config import WorkerConfig
from worker_svc.cpu import binding as cpu_binding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text,cpus", [("0-3", [0, 1, 2, 3]), ("0-1,8,10-11", [0, 1, 8, 10, 11]), ("5", [5]),
                                       (" 2 , 4-5", [2, 4, 5])])
def test_core_lists_parse(text, cpus):
    assert cpu_binding.parse_cpus(text) == cpus


@pytest.mark.parametrize("value", ["3-1", "a", "0-", "1,1", "", "0-3|x"])
def test_malformed_values_are_refused_naming_the_form(value):
    message = cpu_binding.check(value)
    assert message is not None and "0-3|4-7" in message


@pytest.mark.parametrize("value", ["auto", "nobind", "0-3|4-7", "0,2|1,3", "7"])
def test_well_formed_values_pass(value):
    assert cpu_binding.check(value) is None


def test_auto_splits_the_allowed_cores_among_the_local_ranks():
    allowed = [4, 5, 6, 7, 0, 1, 2, 3]
    assert cpu_binding.rank_cpus("auto", allowed, 8, 0, 1) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cpu_binding.rank_cpus("auto", allowed, 4, 0, 2) == [0, 1, 2, 3]
    assert cpu_binding.rank_cpus("auto", allowed, 4, 1, 2) == [4, 5, 6, 7]
    assert cpu_binding.rank_cpus("auto", [0, 1, 2], 1, 2, 3) == [2]


def test_auto_leaves_a_rank_with_fewer_threads_than_cores_unbound():
    # e.g. OMP_NUM_THREADS=2 for each of two workers on 4 cores: pinning both to cores 0-1 would stack them
    assert cpu_binding.rank_cpus("auto", [0, 1, 2, 3], 2, 0, 1) is None
    assert cpu_binding.rank_cpus("auto", [0], 1, 0, 2) is None  # fewer cores than ranks


def test_nobind_and_explicit_lists():
    assert cpu_binding.rank_cpus("nobind", [0, 1], 2, 0, 1) is None
    assert cpu_binding.rank_cpus("0-1|2-3", [0, 1, 2, 3], 2, 1, 2) == [2, 3]


def test_a_list_per_rank_must_match_the_local_ranks():
    with pytest.raises(ValueError, match=r"--cpu-omp-threads-bind '0-1\|2-3' names 2 core list\(s\) for the 1"):
        cpu_binding.rank_cpus("0-1|2-3", [0, 1, 2, 3], 4, 0, 1)


def test_cores_outside_the_allowed_set_are_refused():
    with pytest.raises(ValueError, match=r"cores \[9\] are not among the 4 this process may run on \(0-3\)"):
        cpu_binding.rank_cpus("2,9", [0, 1, 2, 3], 2, 0, 1)


def test_the_setting_defaults_to_auto_as_vllm():
    assert WorkerConfig().cpu_omp_threads_bind == "auto"


def test_without_the_compiled_kernels_the_whole_process_is_kept_to_the_list():
    core = max(os.sched_getaffinity(0))
    code = ("import os, threading; from worker_svc.cpu import binding as cpu_binding\n"
            "t = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True); t.start()\n"
            f"print(cpu_binding.bind([{core}]))\n"
            "print(sorted({tuple(sorted(os.sched_getaffinity(int(x)))) for x in os.listdir('/proc/self/task')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LLMSERVE_CPU_KERNELS": "0"})
    assert out.returncode == 0, out.stderr
    assert "process kept to cores" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == str([(core,)])
