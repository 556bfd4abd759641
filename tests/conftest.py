import os
import shutil
import sys
import tempfile

import pytest

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next one: the run keeps
# several worker processes (each with a thread per core) and pytest processes on a 2-core box, where a spinning
# thread only takes the core from a process with work (12% less CPU for tests/e2e/test_scheduler_e2e.py alone).
# Read when torch loads its OpenMP runtime: set before the import below, inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The shared harness (tests/support/): a failing test's report gets the logs of the processes still running, every
# test may ask for the session's `redis_server` by name, and the longest files are queued first.
pytest_plugins = ("tests.support.cluster", "tests.support.redis_fixture", "tests.support.file_order")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run in the interpreter; it must be chosen before triton is first imported
# (transformers imports it too), and it stays on for the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every worker and scheduler start would parse the bundled GGUF again (~10-20 s each on this box): one cache per
# run (common/gguf_cache.py), so each run's first load still goes through the real parser. Set the variable to
# keep one across runs.
_OWN_GGUF_CACHE = "LLMSERVE_GGUF_CACHE_DIR" not in os.environ
if _OWN_GGUF_CACHE:
    os.environ["LLMSERVE_GGUF_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmserve-gguf-cache-")

# The HF reference (tests/support/hf_reference.py): transformers' load of the GGUF, saved once per machine under a
# folder keyed by what determines it (the GGUF's bytes, the transformers and torch versions, the module that builds
# it), read by every pytest process of every run; the results computed from it stay per run. The variables are set
# before pytest-xdist starts the processes, so they inherit them.
if "LLMSERVE_TEST_HF_CACHE_DIR" not in os.environ:
    from tests.support.hf_reference import default_cache_dir

    os.environ["LLMSERVE_TEST_HF_CACHE_DIR"] = default_cache_dir()
_OWN_HF_RESULTS = "LLMSERVE_TEST_HF_RESULTS_DIR" not in os.environ
if _OWN_HF_RESULTS:
    os.environ["LLMSERVE_TEST_HF_RESULTS_DIR"] = tempfile.mkdtemp(prefix="llmserve-hf-results-")


@pytest.fixture(autouse=True, scope="module")
def _stop_leftover_processes():
    """Processes a module started and did not stop (a failed test, a fixture that never reached its teardown) end
    with the module instead of slowing every later one. The session's redis-server stays."""
    from llmserve.processes import live, stop

    before = {id(p) for p in live()}
    yield
    for proc in live():
        if id(proc) not in before and proc.kind != "redis":
            stop(proc)


def pytest_sessionfinish(session, exitstatus):
    from llmserve.processes import stop_all
    from tests.support.cli_forks import close_shared

    stop_all(everything=True)
    close_shared()


def pytest_unconfigure(config):
    if _OWN_GGUF_CACHE:
        shutil.rmtree(os.environ["LLMSERVE_GGUF_CACHE_DIR"], ignore_errors=True)
    if _OWN_HF_RESULTS:
        shutil.rmtree(os.environ["LLMSERVE_TEST_HF_RESULTS_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    from worker_svc.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_model_path):
    """transformers' tokenizer of the bundled GGUF (loaded from it once per machine for every pytest process)."""
    from tests.support.hf_reference import load_tokenizer

    return load_tokenizer(bundled_model_path, os.environ["LLMSERVE_TEST_HF_CACHE_DIR"])


@pytest.fixture(scope="session")
def hf_model(bundled_model_path):
    """transformers' float32 model of the bundled GGUF (loaded from it once per machine for every pytest process)."""
    from tests.support.hf_reference import load_model

    return load_model(bundled_model_path, os.environ["LLMSERVE_TEST_HF_CACHE_DIR"])


@pytest.fixture(scope="session")
def runner(bundled_model_path):
    from worker_svc.config import WorkerConfig
    from worker_svc.core.runner import ModelRunner

    return ModelRunner(WorkerConfig(model=bundled_model_path, dtype="float32", num_gpu_blocks_override=512))


def pytest_collection_modifyitems(config, items):
    """The default run leaves out tests marked `slow` (README, "Tests"); they run with LLMSERVE_TEST_ALL=1
    (`./scripts/test.sh --all`), with any `-m` expression (`-m slow`: only them), or when named by node id.
    LLMSERVE_TEST_FAST=1 (`./scripts/test.sh --fast`) leaves out the `heavy` ones too, the same way."""
    if os.environ.get("LLMSERVE_TEST_ALL") == "1" or config.getoption("markexpr"):
        return
    left_out_marks = ("slow", "heavy") if os.environ.get("LLMSERVE_TEST_FAST") == "1" else ("slow",)
    named = {arg.split("[")[0] for arg in config.args if "::" in arg}
    keep, left_out = [], []
    for item in items:
        marked = any(item.get_closest_marker(mark) is not None for mark in left_out_marks)
        (left_out if marked and item.nodeid.split("[")[0] not in named else keep).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep
