"""Concurrent requests through a fresh scheduler in front of a running worker, for the speculation tests that
compare every sequence against a reference and read the draft counters (vllm:spec_decode_*) afterwards."""

from __future__ import annotations

import threading
import uuid

import grpc

from llmserve.bench.metrics import summed_metrics
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster

TIMEOUT_S = 600
Job = tuple[list[int], int, dict]  # (prompt ids, max_tokens, further SamplingParams fields)


def request_tokens(address: str, ids: list[int], max_tokens: int, params: dict, rid: str | None = None,
                   timeout: float = TIMEOUT_S) -> list[list[int]]:
    """One Generate call to its end (ignore_eos, so max_tokens each): one token list per sequence."""
    req = pb.GenerateRequest(request_id=rid or uuid.uuid4().hex[:8],
                             sampling=pb.SamplingParams(ignore_eos=True, max_tokens=max_tokens, **params))
    req.token_ids.SetInParent()
    req.token_ids.ids.extend(ids)
    seqs: dict[int, list[int]] = {}
    with grpc.insecure_channel(address) as channel:
        for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=timeout):
            seqs.setdefault(msg.index, []).extend(msg.token_ids)
    return [seqs[i] for i in sorted(seqs)]


def serve_concurrently(redis_server, worker, jobs: list[Job], flags: list,
                       namespace: str) -> tuple[dict[int, list[list[int]]], dict[str, float]]:
    """All jobs at once through a scheduler started for them (32-token chunks, ledger invariants checked each
    step, `flags` added) and stopped after: the sequences of each job by index, and the scheduler's metrics."""
    metrics_port = cluster.free_port()
    sched = cluster.start_scheduler(redis_server, worker, ["--max-num-batched-tokens", 32, "--debug-invariants",
                                                           "--metrics-port", metrics_port, *flags],
                                    namespace=cluster.new_namespace(namespace))
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        results: dict[int, list[list[int]]] = {}

        def run(i: int, prompt: list[int], max_tokens: int, params: dict) -> None:
            results[i] = request_tokens(sched.address, prompt, max_tokens, params)

        threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert len(results) == len(jobs), f"{len(jobs) - len(results)} of {len(jobs)} requests did not finish"
        return results, summed_metrics(metrics_port)
    finally:
        cluster.stop(sched)
