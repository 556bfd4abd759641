"""Prompt logprobs across a scheduler take-over: neither lost nor sent twice.

They are not stored in Redis (docs/redis-ledger.md): the new leader resumes the request by recomputing its prompt,
which scores it again. A client that had its first message re-attaches from a later token and gets no second copy;
a client that had seen nothing re-attaches from token 0 and gets them, equal to the first leader's.
"""

from __future__ import annotations

import grpc
import pytest

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.stack import start_scheduler_in_process

PROMPT = ("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
          "and an oozy smell.")
MAX_TOKENS = 160


def request(resume_from: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="plp-takeover", text=PROMPT, resume_from_token=resume_from,
                              sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                         prompt_logprobs=2))


def test_prompt_logprobs_survive_a_scheduler_takeover(redis_server):
    worker = cluster.start_worker(["--num-gpu-blocks-override", "128", "--max-model-len", "512"])
    args = ["--lease-ttl-ms", "1500", "--namespace", cluster.new_namespace("plp")]
    first = start_scheduler_in_process(redis_server, worker, args)
    try:
        with grpc.insecure_channel(first.address) as ch:
            stream = pb_grpc.LLMServeStub(ch).Generate(request(), timeout=300)
            head = next(stream)
            assert head.prompt_token_ids and len(head.prompt_logprobs) == len(head.prompt_token_ids) - 1
            seen = list(head.token_ids)
            for msg in stream:  # a few more tokens, then the leader goes away mid-generation
                seen += msg.token_ids
                if len(seen) >= 4:
                    break
            port = first.port
            first.stop(0)  # the request stays in Redis, unfinished
            first = None
            with pytest.raises(grpc.RpcError) as e:
                for msg in stream:
                    seen += msg.token_ids
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(seen) < MAX_TOKENS, "taken over mid-generation"
        second = start_scheduler_in_process(redis_server, worker, args, port=port)
        try:
            with grpc.insecure_channel(second.address) as ch:
                stub = pb_grpc.LLMServeStub(ch)
                fresh = list(stub.Generate(request(0), timeout=300))  # a client that had seen nothing
                rest = list(stub.Generate(request(len(seen)), timeout=300))  # the client that had its head
        finally:
            second.stop(0)
    finally:
        if first is not None:
            first.stop(0)
        cluster.stop(worker)
    assert list(fresh[0].prompt_token_ids) == list(head.prompt_token_ids)
    for a, b in zip(fresh[0].prompt_logprobs, head.prompt_logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    assert sum(bool(m.prompt_token_ids) for m in fresh) == 1, "sent once per stream"
    assert not any(m.prompt_token_ids or m.prompt_logprobs for m in rest), "never twice to the same client"
    assert [t for m in fresh for t in m.token_ids] == seen + [t for m in rest for t in m.token_ids]
    assert len(seen) + sum(len(m.token_ids) for m in rest) == MAX_TOKENS
