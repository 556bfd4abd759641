"""EAGLE-3 speculation end to end (real worker, scheduler and Redis): a random-weight EAGLE-3 head beside the bundled
model (the worker loads it from --speculative-config, reading the default auxiliary layers 2, 15 and 27), the mixed
batch of tests/e2e/test_speculative.py -- greedy, seeded sampling, n = 2, a regex-constrained request -- on a
16-block pool that preempts, with chunked prefill and prefix caching on, pipelined: token for token what each
request gives alone without speculation. The head's drafts are verified and counted (vllm:spec_decode_*); with
random weights hardly any is accepted, which is what the test expects of them."""

from __future__ import annotations

import json
import re

import pytest

from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_scheduler_e2e import (
    SMALL_BLOCKS,
    WORKERS,
    assert_clean_log,
    metrics,
    run_concurrently,
    wait_idle_ledger,
)
from tests.e2e.test_speculative import CASES, COUNT_RE, run, scheduler
from tests.support import cluster
from tests.support.module_worker import running_worker
from tests.support.spec_heads import bundled_model_dims, write_eagle3_head


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    head = write_eagle3_head(str(tmp_path_factory.mktemp("eagle3")), aux_layers=None, dims=bundled_model_dims(),
                             draft_vocab=2048)
    return json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def worker(spec):
    with running_worker([*WORKERS["small"], "--speculative-config", spec]) as w:
        yield w


def test_eagle3_speculation_equals_plain_decoding_with_preemption(redis_server, worker, spec):  # noqa: F811
    plain, ch = scheduler(redis_server, worker)  # no draft slots: the worker's head only keeps its KV
    stub = pb_grpc.LLMServeStub(ch)
    refs = [run(stub, p, m, **kw) for p, m, kw in CASES]
    ch.close()
    cluster.stop(plain)
    assert_clean_log(plain)
    assert re.fullmatch(COUNT_RE, refs[-1][0][1])
    proc, ch = scheduler(redis_server, worker, "--speculative-config", spec)
    stub = pb_grpc.LLMServeStub(ch)
    outs = run_concurrently([lambda p=p, m=m, kw=kw, stub=stub: run(stub, p, m, **kw) for p, m, kw in CASES])
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out == ref, f"case {i} differs with eagle3 speculation on"
    got = metrics(proc.extra["metrics_port"])
    assert got.get("vllm:num_preemptions_total", 0) > 0, "the run was meant to preempt"
    assert got["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert got["vllm:spec_decode_num_draft_tokens_total"] >= got["vllm:spec_decode_num_accepted_tokens_total"]
    wait_idle_ledger(redis_server, proc.namespace, SMALL_BLOCKS)
    ch.close()
    cluster.stop(proc)
    assert_clean_log(proc)
