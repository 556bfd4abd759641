"""The longest test files first, so that the pytest processes end together.

Under `-n 2 --dist loadfile` each process takes whole files from one queue. pytest-xdist orders that queue by the
number of tests in a file, most first: the many-test unit files went first and the end-to-end files (a few long tests
each, minutes of started servers) came last, so the run ended with one process on a long file and the other idle.
Here the queue starts with the files measured longest (largest first, the classic longest-job-first rule), then
every other file in pytest's order. A new file that runs for minutes belongs in `LONGEST_FIRST`.
(Registered by tests/conftest.py.)
"""

from __future__ import annotations

import pytest

# The 30 longest files of the default run of 2026-12-07 22:34 on a quiet box (setup, call and teardown summed per
# file, junit; the two kernel-tier files, which waited on a compile then, left out), largest first; together 72% of its
# time.
LONGEST_FIRST: tuple[str, ...] = (
    "tests/e2e/test_prefix_cache.py",
    "tests/service/test_worker_runner.py",
    "tests/e2e/test_redis_failover.py",
    "tests/e2e/test_tensor_parallel_e2e.py",
    "tests/e2e/test_tool_calling.py",
    "tests/e2e/test_compiled_stack.py",
    "tests/e2e/test_scheduler_e2e.py",
    "tests/e2e/test_triton_attention.py",
    "tests/e2e/test_tls.py",
    "tests/e2e/test_speculative_structured.py",
    "tests/e2e/test_recovery.py",
    "tests/e2e/test_redis_outage.py",
    "tests/e2e/test_openai_api.py",
    "tests/e2e/test_draft_model.py",
    "tests/e2e/test_lora_e2e.py",
    "tests/e2e/test_structured_outputs.py",
    "tests/e2e/test_hybrid_speculative.py",
    "tests/e2e/test_compiled_hybrid_served.py",
    "tests/e2e/test_speculative.py",
    "tests/e2e/test_serve.py",
    "tests/e2e/test_speculative_tensor_parallel.py",
    "tests/e2e/test_speculative_heads.py",
    "tests/e2e/test_tensor_parallel.py",
    "tests/e2e/test_api_fuzz.py",
    "tests/e2e/test_hybrid_lora.py",
    "tests/service/test_speculative_worker.py",
    "tests/service/test_compiled_hybrid.py",
    "tests/e2e/test_worker_rejects.py",
    "tests/e2e/test_queued_requests.py",
    "tests/e2e/test_scheduling_modes.py",
)


def file_rank(nodeid: str) -> int:
    """Where a test's file goes in the queue: its place in `LONGEST_FIRST`, else after all of them."""
    path = nodeid.split("::", 1)[0]
    try:
        return LONGEST_FIRST.index(path)
    except ValueError:
        return len(LONGEST_FIRST)


def pytest_configure(config: pytest.Config) -> None:
    # The controller takes the queue in the order the processes collected (below), not by test count.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: file_rank(item.nodeid))  # stable: each file's tests keep their order
