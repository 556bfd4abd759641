"""Mixtral and Qwen3-MoE served end to end: a transformers-written random checkpoint behind a real worker,
scheduler and redis-server, six concurrent greedy requests in a 32-token step budget (chunked prefill, mixed
prefill + decode steps) and a 14-block pool that cannot hold them all (preemption). Each request's tokens equal
transformers' greedy tokens up to the first step where transformers' own top-2 margin is not clear; so do they
with the experts (and the dense layer) sharded over two tensor-parallel ranks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_prefix_cache import metrics
from tests.support import cluster
from tests.support import moe_checkpoints as mc

MAX_TOKENS = 24
WORKER_ARGS = ["--num-gpu-blocks-override", 14, "--block-size", 16, "--max-model-len", 128,
               "--allow-kv-pool-below-max-model-len"]
SCHEDULER_ARGS = ["--max-num-batched-tokens", 32, "--debug-invariants"]
TIMEOUT_S = 300


def _generate(address: str, ids: list[int], rid: str) -> tuple[list[int], str]:
    req = pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True,
                                                                        max_tokens=MAX_TOKENS))
    req.token_ids.ids.extend(ids)
    tokens, finish = [], ""
    try:
        with grpc.insecure_channel(address) as channel:
            for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=TIMEOUT_S):
                tokens.extend(msg.token_ids)
                finish = finish or msg.finish_reason
    except grpc.RpcError as e:
        finish = f"{e.code().name}: {e.details()}"
    return tokens, finish


# Qwen3-MoE on one rank is slow: the same checks run on two ranks by default, and one rank against transformers in
# tests/service/test_moe_models.py::test_chunked_prefill_and_decode_match_transformers.
@pytest.mark.parametrize("family,tp", [("mixtral", 1), pytest.param("qwen3_moe", 1, marks=pytest.mark.slow),
                                       ("qwen3_moe", 2)])
def test_greedy_tokens_match_transformers(redis_server, tmp_path, family, tp):
    hf = mc.write_checkpoint(family, str(tmp_path))
    prompts = mc.prompts(6, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [mc.clear_prefix(*mc.hf_greedy(hf, ids, MAX_TOKENS)) for ids in prompts]
    finally:
        torch.set_num_threads(threads)
    assert sum(map(len, expected)) >= 4 * MAX_TOKENS, "too few clear greedy steps to compare"

    worker = cluster.start_worker(["--model", tmp_path, *WORKER_ARGS, "--tensor-parallel-size", tp])
    sched = None
    try:
        metrics_port = cluster.free_port()
        sched = cluster.start_scheduler(redis_server, worker, [*SCHEDULER_ARGS, "--metrics-port", metrics_port])
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        with ThreadPoolExecutor(len(prompts)) as pool:  # all six at once
            results = list(pool.map(_generate, [sched.address] * len(prompts), prompts,
                                    [f"{family}-{i}" for i in range(len(prompts))]))
        assert metrics(metrics_port).get("vllm:num_preemptions_total", 0) > 0, "the pool was meant to run dry"
        for i, (want, (tokens, finish)) in enumerate(zip(expected, results, strict=True)):
            assert finish == "length", (i, finish)
            assert len(tokens) == MAX_TOKENS
            assert tokens[:len(want)] == want, f"request {i}: greedy tokens differ from transformers'"
    finally:
        if sched is not None:
            cluster.stop(sched)
        cluster.stop(worker)
