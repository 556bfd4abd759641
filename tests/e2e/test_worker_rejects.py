"""A request the worker refuses fails alone: INVALID_ARGUMENT for it, every other stream goes on unchanged, and the
scheduler keeps its lease (real worker process, real Redis, in-process scheduler behind its real gRPC server).

Admission already refuses token ids outside the model's vocabulary, so the bad request is handed to the driver below
admission (`Driver.submit`), as a scheduler whose limits disagree with its worker would send it."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
import transformers

from common.sampling_fields import SamplingParams
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.core.request import Request
from tests.support import cluster

PROMPTS = [[100 + 37 * i + j for j in range(12 + 3 * i)] for i in range(8)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(redis_server):  # noqa: F811
    from tests.support.stack import start_scheduler_in_process

    worker = cluster.start_worker(["--num-gpu-blocks-override", 256, "--max-model-len", 512])
    sched = start_scheduler_in_process(redis_server, worker, ["--namespace", cluster.new_namespace("reject"),
                                                              "--max-num-batched-tokens", 64, "--debug-invariants"])
    try:
        yield argparse.Namespace(driver=sched.driver, ledger=sched.ledger, address=sched.address, worker=worker)
    finally:
        sched.stop()
        cluster.stop(worker)


def _stream(address: str, prompt: list[int], out: dict, key, first: threading.Event | None = None) -> None:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        toks = []
        for msg in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300):
            toks += msg.token_ids
            if first is not None and toks:
                first.set()
        out[key] = toks


def test_a_request_the_worker_rejects_fails_alone(stack):
    alone: dict = {}
    for i, p in enumerate(PROMPTS):  # the reference: each prompt served alone
        _stream(stack.address, p, alone, i)
    token_before = stack.driver.lease.token
    vocab = stack.driver.worker_info.model.vocab_size

    got: dict = {}
    started = [threading.Event() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(stack.address, p, got, i, started[i]))
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started), "the good streams did not start"
    bad = Request(request_id="bad-1", prompt_ids=[1, 2, vocab + 7], arrival_time=time.time(),
                  sampling=SamplingParams(temperature=0.0, seed=1, max_tokens=4))
    stack.driver.submit([bad])
    with grpc.insecure_channel(stack.address) as ch, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.LLMServeStub(ch).Generate(pb.GenerateRequest(request_id="bad-1"), timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad-1" in err.value.details() and f"token id {vocab + 7} is outside the vocabulary" in err.value.details()
    for t in threads:
        t.join(300)
    assert got == alone, "a stream changed because another request was rejected"
    # The same leadership throughout: no step-down, no new lease, and the ledger is clean.
    assert stack.driver.lease.token == token_before and stack.driver.ready.is_set()
    deadline = time.monotonic() + 10
    while stack.driver.core.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    led = stack.ledger.check_ledger()
    assert led["allocated"] == 0 and led["active"] == 0 and led["overlap"] == 0
    assert led["free"] + led["evictable"] == led["total"], "a block leaked"


def test_a_tokenizer_larger_than_the_model_is_refused_at_start(redis_server, tmp_path, bundled_model_path):  # noqa: F811
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    worker = cluster.start_worker(["--model", tmp_path, "--num-gpu-blocks-override", 64, "--max-model-len", 256])
    try:
        res = subprocess.run(
            [sys.executable, "-m", "llmserve.cli", "scheduler", "--redis-url", redis_server, "--worker-address",
             worker.address, "--namespace", cluster.new_namespace("tok"), "--port", "0", "--tokenizer",
             bundled_model_path], cwd=cluster.ROOT, capture_output=True, text=True, timeout=180)
    finally:
        cluster.stop(worker)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert f"--tokenizer {bundled_model_path} has 49152 tokens" in out and "vocabulary of 256" in out, out[-3000:]


def test_the_worker_says_why_it_refused_a_plan_in_trailing_metadata(stack):
    """Fencing is told apart from a bad entry by the worker's structured reason, not by its message text."""
    from protos import worker_pb2 as wpb
    from scheduler_svc.driver.worker_client import PlanRejected, WorkerClient, WorkerFenced, WorkerLost

    client = WorkerClient(stack.worker.address)
    info = client.describe()
    with pytest.raises(WorkerFenced):  # an older fencing token than the leading scheduler's
        client.execute(wpb.StepPlan(step_id=info.last_step_id + 10_000, fencing_token=0))
    with pytest.raises(WorkerLost):  # a stale epoch: the KV is gone, not a bad request
        client.execute(wpb.StepPlan(step_id=info.last_step_id + 10_000, fencing_token=info.fencing_token,
                                    expected_epoch="not-this-one"))
    # A cached entry for a slot the worker holds nothing in (the stack is idle): the worker names the slot, and the
    # client maps it back to the request it gave that slot.
    slot = client.slots.join("nobody")
    plan = wpb.StepPlan(step_id=info.last_step_id + 10_000, fencing_token=info.fencing_token)
    plan.cached.slots.append(slot)
    plan.cached.num_scheduled_tokens.append(1)
    with pytest.raises(PlanRejected) as err:
        client.execute(plan)
    assert err.value.request_id == "nobody" and f"slot {slot} holds no request" in str(err.value)
