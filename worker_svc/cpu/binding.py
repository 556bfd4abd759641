"""Which cores a worker's model threads run on: `--cpu-omp-threads-bind`, vLLM's VLLM_CPU_OMP_THREADS_BIND.

`auto` gives each tensor-parallel rank on this host an equal share of the cores this process may run on (in order),
when the rank runs a thread per core of that share (with fewer, set by OMP_NUM_THREADS, it is left unbound);
`nobind` leaves the threads to the OS, and a list per local rank (`0-3|4-7`, `0,2|1,3`) names them. A bound rank
runs one thread per core of its list; each thread stays on its core, so the ranks of one host never share a core and a
thread does not wander between cores mid-step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

FLAG = "--cpu-omp-threads-bind"


def parse_cpus(text: str) -> list[int]:
    """`0-3,8,10-11` -> [0, 1, 2, 3, 8, 10, 11]; ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} is not a core number or range (e.g. 0-3,8)")
        cpus.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{text!r} names a core twice")
    return cpus


def check(value: str) -> str | None:
    """The setting's format (the rank count is checked at start, once it is known)."""
    if value in ("auto", "nobind"):
        return None
    try:
        for ranks in value.split("|"):
            parse_cpus(ranks)
    except ValueError as e:
        return f"must be auto, nobind or core lists per local rank such as 0-3|4-7: {e}"
    return None


def rank_cpus(value: str, allowed: Sequence[int], threads: int, local_rank: int, local_size: int) -> list[int] | None:
    """The cores local rank `local_rank` of `local_size`, running `threads` threads, binds them to (None: not
    bound). Raises ValueError naming the flag for a list that does not fit."""
    if value == "nobind":
        return None
    if value == "auto":
        # Only a rank that runs a thread on every core of its share is bound: fewer threads (OMP_NUM_THREADS) mean
        # the cores are shared with something else, such as a second worker, which would then pin to the same ones.
        share = len(allowed) // local_size
        if share == 0 or threads < share:
            return None
        return sorted(allowed)[local_rank * share:(local_rank + 1) * share]
    lists = value.split("|")
    if len(lists) != local_size:
        raise ValueError(f"{FLAG} {value!r} names {len(lists)} core list(s) for the {local_size} tensor-parallel "
                         f"rank(s) on this host (one per rank, separated by |)")
    cpus = parse_cpus(lists[local_rank])
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"{FLAG} {value!r}: cores {outside} are not among the {len(allowed)} this process may run "
                         f"on ({_ranges(sorted(allowed))})")
    return cpus


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _ranges(cpus: list[int]) -> str:
    out, start = [], 0
    for i in range(1, len(cpus) + 1):
        if i == len(cpus) or cpus[i] != cpus[i - 1] + 1:
            out.append(str(cpus[start]) if i - 1 == start else f"{cpus[start]}-{cpus[i - 1]}")
            start = i
    return ",".join(out)


def bind(cpus: list[int]) -> str:
    """Pins the calling thread's OpenMP team to `cpus`, thread i to cpus[i] (the model's threads: call it on the thread
    that runs the steps, after the threads that must stay free, such as gRPC's, have started). Without the compiled
    kernels, every thread of the process is kept to the list instead. Returns what was done, for the log."""
    from kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
        return f"process kept to cores {_ranges(cpus)} (no compiled kernels: threads not pinned one by one)"
    refused = ops.bind_omp_threads(cpus)
    if refused:
        raise ValueError(f"{FLAG}: cores {refused} refused the model's threads")
    return f"model threads pinned to cores {_ranges(cpus)}"
