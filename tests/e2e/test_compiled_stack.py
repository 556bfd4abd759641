"""The compiled forward (-O1) behind the real scheduler and Redis: the speculative test's mixed batch (greedy, seeded
sampling, n = 2, a regex-constrained request, prompts that preempt on a 16-block pool, chunked prefill beside
decodes), run concurrently with speculation off and on, and on a tensor-parallel group of three compiled ranks, gives
token for token what each request gives alone on the eager worker; the block ledger ends clean."""

from __future__ import annotations

import pytest

from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_scheduler_e2e import (
    MAX_MODEL_LEN,
    SMALL_BLOCKS,
    assert_clean_log,
    metrics,
    run_concurrently,
    wait_idle_ledger,
)
from tests.e2e.test_speculative import CASES, SPEC, run, scheduler
from tests.support import cluster
from tests.support.module_worker import running_worker

# On the CPU wherever it runs: three ranks need three devices on CUDA (tests/service/test_cuda_graphs.py is the GPU's).
POOL = ["--device", "cpu", "--num-gpu-blocks-override", SMALL_BLOCKS, "--max-model-len", MAX_MODEL_LEN,
        "--allow-kv-pool-below-max-model-len"]
# Steps of 1-64 tokens (the scheduler's budget is 64) padded to three sizes; a verify step past 64 runs eager.
SIZES = '{"cudagraph_capture_sizes": [4, 16, 64]}'


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


@pytest.fixture(scope="module")
def refs(redis_server):  # noqa: F811
    """Each case alone on the eager worker."""
    eager = cluster.start_worker(POOL)
    plain, ch = scheduler(redis_server, eager)
    stub = pb_grpc.LLMServeStub(ch)
    out = [run(stub, p, m, **kw) for p, m, kw in CASES]
    ch.close()
    cluster.stop(plain)
    cluster.stop(eager)
    return out


def run_cases(redis_server: str, worker: cluster.Proc, flags: list[str], refs: list) -> None:
    """CASES concurrently through a scheduler with `flags` on `worker`: each as in `refs`, with preemptions."""
    proc, ch = scheduler(redis_server, worker, *flags)
    stub = pb_grpc.LLMServeStub(ch)
    outs = run_concurrently([lambda p=p, m=m, kw=kw: run(stub, p, m, **kw) for p, m, kw in CASES])
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out == ref, f"{flags}: case {i} differs on the compiled worker"
    got = metrics(proc.extra["metrics_port"])
    assert got.get("vllm:num_preemptions_total", 0) > 0, "the run was meant to preempt"
    if flags:
        assert got["vllm:spec_decode_num_accepted_tokens_total"] > 10
    wait_idle_ledger(redis_server, proc.namespace, SMALL_BLOCKS)
    ch.close()
    cluster.stop(proc)
    assert_clean_log(proc)


@pytest.fixture(scope="module")
def compiled(inductor_cache):
    with running_worker([*POOL, "-O1", "--compilation-config", SIZES], env=inductor_cache) as worker:
        assert "compiled forward ready: sizes [4, 16, 64]" in worker.log_text()
        yield worker


# Without speculation is slow: the speculative run's steps hold the rows without drafts too (decodes, the regex row),
# the compiled forward alone against the eager one is tests/service/test_compiled_forward.py, and the same cases
# through the scheduler without speculation are tests/e2e/test_speculative.py's reference run.
@pytest.mark.parametrize("flags", [pytest.param([], marks=pytest.mark.slow), ["--speculative-config", SPEC]],
                         ids=["plain", "speculative"])
def test_compiled_worker_equals_eager_under_every_mode(redis_server, refs, compiled, flags):  # noqa: F811
    run_cases(redis_server, compiled, flags, refs)


# slow: three compiling ranks; the compiled forward's tensor-parallel logits are checked in the default run by
# tests/e2e/test_tensor_parallel.py::test_sharded_logits_match_one_rank (N = 2), the compiled worker behind the
# scheduler by the test above, and a served tensor-parallel group by tests/e2e/test_tensor_parallel_e2e.py.
@pytest.mark.slow
def test_compiled_tensor_parallel_group_equals_eager(redis_server, refs, inductor_cache):  # noqa: F811
    """Three ranks (SmolLM2's 9 query and 3 KV heads), each compiling its shard's parts, all-reduces between them."""
    with running_worker([*POOL, "--tensor-parallel-size", 3, "-O1", "--compilation-config", SIZES],
                        env=inductor_cache) as group:
        assert "compiled forward ready: sizes [4, 16, 64]" in group.log_text()
        run_cases(redis_server, group, ["--speculative-config", SPEC], refs)
