"""worker_svc.server.ComputeThread: every step of a worker runs on the thread that loaded the model (one OpenMP
pool), whichever gRPC thread took the call; results, exceptions and the caller's context cross back."""

from __future__ import annotations

import contextvars
import threading
from concurrent import futures

import pytest

from worker_svc.server import ComputeThread

trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="none")


def test_calls_from_many_threads_run_on_the_compute_thread_in_turn():
    compute = ComputeThread()
    stop = threading.Event()
    seen: list[int] = []

    def job(i: int) -> tuple[int, int]:
        seen.append(i)
        return i * i, threading.get_ident()

    with futures.ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(compute.call, job, i) for i in range(40)]
        pool.submit(lambda: (futures.wait(calls), stop.set()))
        compute.run_until(stop.is_set, poll_s=0.01)  # this thread is the compute thread
    here = threading.get_ident()
    assert [c.result() for c in calls] == [(i * i, here) for i in range(40)]
    assert sorted(seen) == list(range(40))


def _as_compute_thread(compute: ComputeThread, caller):
    """Runs `caller` on another thread while this thread serves `compute`, until the caller returns; its result."""
    stop = threading.Event()

    def then_stop():
        try:
            return caller()
        finally:
            stop.set()

    with futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(then_stop)
        compute.run_until(stop.is_set, poll_s=0.01)
        return result.result(timeout=10)


def test_an_exception_reaches_the_caller_and_the_loop_goes_on():
    compute = ComputeThread()

    def fails() -> None:
        raise ValueError("bad plan")

    def caller() -> str:
        with pytest.raises(ValueError, match="bad plan"):
            compute.call(fails)
        return compute.call(str.upper, "next")

    assert _as_compute_thread(compute, caller) == "NEXT"


def test_the_callers_context_travels_with_the_call():
    """The step's trace span is the gRPC thread's current context: the phases' spans must see it."""
    compute = ComputeThread()

    def caller() -> str:
        trace_id.set("step-7")
        return compute.call(trace_id.get)

    assert _as_compute_thread(compute, caller) == "step-7"
    assert trace_id.get() == "none"
