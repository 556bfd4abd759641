"""The scheduler's own sampling record: its Redis encoding (JSON, under a schema_version the ledger checks at
start-up), admission's defaults and n > 1 copies, and its translation to the worker's wire message."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest
import redis

from common.sampling_fields import SamplingParams
from common.validation import ConfigError
from protos import llmserve_pb2 as pb
from protos import worker_pb2 as wpb
from scheduler_svc.core.request import Request, Status
from scheduler_svc.driver.admission import Limits, build_requests
from scheduler_svc.driver.worker_client import sampling_to_wire
from scheduler_svc.ledger.store import SCHEMA_VERSION, RedisLedger, SchemaMismatch, StepCommit

HOLDER = "sched-a"
TTL_MS = 5000

# Every field off its default (seed at the top of admission's range, floats exact in float32 for the wire test).
FULL = SamplingParams(temperature=0.75, top_k=40, top_p=0.875, min_p=0.0625, repetition_penalty=1.25,
                      presence_penalty=-0.5, frequency_penalty=1.5, seed=(1 << 63) - 1, ignore_eos=True, min_tokens=3,
                      max_tokens=17, stop_token_ids=[2, 7, 11], logprobs=5,
                      constraint={"kind": "json_schema", "spec": '{"type": "object"}'},
                      logit_bias={3: -100.0, 17: 0.5}, bad_words=[[5, 6], [9]], prompt_logprobs=2, embed=True)


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis.Redis.from_url(redis_server)
    c.flushdb()
    yield c
    c.close()


def _request(rid: str, sampling: SamplingParams, seq: int = 0) -> Request:
    return Request(request_id=rid, prompt_ids=[5, 6, 7], sampling=sampling, arrival_time=100.0 + seq,
                   arrival_seq=seq, status=Status.WAITING)


# ---- the record itself ------------------------------------------------------------------------------------------


def test_field_names_are_the_worker_messages():
    assert [f.name for f in dataclasses.fields(SamplingParams)] == \
        [f.name for f in wpb.SamplingParams.DESCRIPTOR.fields]


def test_dict_round_trip_is_json_safe():
    for s in (FULL, SamplingParams(), dataclasses.replace(FULL, logprobs=0, seed=0),
              dataclasses.replace(FULL, logprobs=None, seed=None)):
        d = json.loads(json.dumps(s.to_dict()))
        assert SamplingParams.from_dict(d) == s
    assert SamplingParams.from_dict(FULL.to_dict()).stop_token_ids is not FULL.stop_token_ids


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({**FULL.to_dict(), "best_of": 2})


# ---- through Redis ----------------------------------------------------------------------------------------------


def test_every_field_round_trips_through_redis(client):
    led = RedisLedger(client, namespace="rt")
    led.init_pool(8, 4)
    tok = led.try_acquire_lease(HOLDER, TTL_MS)
    cases = {"full": FULL, "lp0": dataclasses.replace(FULL, logprobs=0),
             "lpnone": dataclasses.replace(FULL, logprobs=None), "noseed": dataclasses.replace(FULL, seed=None),
             "defaults": SamplingParams(max_tokens=1)}
    reqs = [_request(rid, s, i) for i, (rid, s) in enumerate(cases.items())]
    led.commit_step(HOLDER, tok, TTL_MS, StepCommit(1, len(reqs), new_requests=reqs))

    loaded = {r.request_id: r.sampling for r in led.load().requests}
    assert loaded == cases
    for rid, s in cases.items():
        assert led.get_request(rid).sampling == s
    assert loaded["lp0"].logprobs == 0 and loaded["lpnone"].logprobs is None

    raw = client.hget(led.prefix + "req:full", "sampling")
    assert json.loads(raw) == json.loads(json.dumps(FULL.to_dict()))  # JSON of the record, not proto bytes
    assert json.loads(client.hget(led.prefix + "req:lpnone", "sampling"))["logprobs"] is None


def test_new_pool_records_the_schema_version(client):
    led = RedisLedger(client, namespace="v")
    led.init_pool(8, 4)
    assert client.hget(led.k_meta, "schema_version") == str(SCHEMA_VERSION).encode()
    assert led.load().meta["schema_version"] == str(SCHEMA_VERSION)
    assert not RedisLedger(client, namespace="v").init_pool(8, 4)  # same version: a new scheduler starts


def _assert_refuses(led: RedisLedger, found: str) -> None:
    for start in (lambda: led.init_pool(8, 4), led.load):
        with pytest.raises(SchemaMismatch) as exc:
            start()
        assert isinstance(exc.value, ConfigError)  # the engine's start-up turns it into a fatal error
        msg = str(exc.value)
        assert found in msg and f"schema_version {SCHEMA_VERSION}" in msg, msg
        assert "--namespace" in msg and "lush" in msg, msg


def test_pool_of_another_schema_version_refuses_to_start(client):
    RedisLedger(client, namespace="old").init_pool(8, 4)
    client.hset("old:{0}:meta", "schema_version", SCHEMA_VERSION + 1)
    _assert_refuses(RedisLedger(client, namespace="old"), f"schema_version {SCHEMA_VERSION + 1}")


def test_pool_from_before_schema_versions_refuses_to_start(client):
    # What the previous release left: no schema_version in meta, sampling as base64 of the worker proto.
    pre = "pre:{0}:"
    client.hset(pre + "meta", mapping={"num_blocks": 8, "block_size": 4, "step_id": 3, "arrival_seq": 1})
    client.sadd(pre + "free", *range(8))
    proto = wpb.SamplingParams(temperature=0.5, seed=9, max_tokens=4)
    client.hset(pre + "req:r", mapping={
        "prompt": "1,2,3", "sampling": base64.b64encode(proto.SerializeToString()), "priority": 0,
        "arrival_time": 1.0, "arrival_seq": 0, "stop": "[]", "include_stop": 0, "skip_special": 1, "cache_salt": "",
        "status": "waiting", "num_computed_tokens": 0, "block_ids": "", "num_preemptions": 0,
        "first_token_time": "", "finish_reason": ""})
    client.sadd(pre + "active", "r")
    led = RedisLedger(client, namespace="pre")
    _assert_refuses(led, "no schema_version")
    assert "schema_version 1" in str(pytest.raises(SchemaMismatch, led.load).value)
    assert client.hget(pre + "meta", "schema_version") is None  # refusing writes nothing


def test_schema_mismatch_comes_before_a_shape_mismatch(client):
    RedisLedger(client, namespace="both").init_pool(8, 4)
    client.hdel("both:{0}:meta", "schema_version")
    with pytest.raises(SchemaMismatch):
        RedisLedger(client, namespace="both").init_pool(16, 4)


# ---- admission ----------------------------------------------------------------------------------------------------

LIMITS = Limits(max_model_len=64, vocab_size=100, kv_pool_tokens=128, block_size=4)


def test_admission_defaults_and_logprobs():
    unset = build_requests(pb.GenerateRequest(sampling=pb.SamplingParams()), [1, 2, 3], LIMITS, "a")[0].sampling
    assert isinstance(unset, SamplingParams)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p, unset.repetition_penalty) == (1.0, 0, 1.0, 0, 1.0)
    assert unset.max_tokens == 64 - 3 and 0 <= unset.seed < 1 << 63 and unset.logprobs is None
    s = build_requests(pb.GenerateRequest(sampling=pb.SamplingParams(logprobs=0, top_k=-1, seed=5, max_tokens=4)),
                       [1], LIMITS, "b")[0].sampling
    assert (s.logprobs, s.top_k, s.seed, s.max_tokens) == (0, 0, 5, 4)


def test_n_siblings_copy_the_record_with_seed_plus_i():
    req = pb.GenerateRequest(sampling=pb.SamplingParams(n=3, seed=(1 << 63) - 2, temperature=0.5, max_tokens=4,
                                                        stop_token_ids=[9]))
    seqs = build_requests(req, [1, 2, 3], LIMITS, "r")
    assert [s.sampling.seed for s in seqs] == [(1 << 63) - 2, (1 << 63) - 1, 0]
    assert all(dataclasses.replace(s.sampling, seed=0) == dataclasses.replace(seqs[0].sampling, seed=0) for s in seqs)
    seqs[1].sampling.stop_token_ids.append(3)
    assert seqs[0].sampling.stop_token_ids == seqs[2].sampling.stop_token_ids == [9]  # nothing shared


# ---- to the worker ------------------------------------------------------------------------------------------------


def test_sampling_to_wire_sets_every_field():
    msg = sampling_to_wire(FULL)
    assert isinstance(msg, wpb.SamplingParams)
    assert msg.HasField("seed") and msg.HasField("logprobs")
    for f in wpb.SamplingParams.DESCRIPTOR.fields:
        got = getattr(msg, f.name)
        if f.name == "stop_token_ids":
            got = list(got)
        elif f.name == "constraint":
            got = {"kind": got.kind, "spec": got.spec}
        elif f.name == "logit_bias":
            got = dict(got)
        elif f.name == "bad_words":
            got = [list(w.ids) for w in got]
        assert got == getattr(FULL, f.name), f.name
    # Every field off its default, so the message is complete: no field left at the proto's zero.
    assert {f.name for f, _ in msg.ListFields()} == {f.name for f in wpb.SamplingParams.DESCRIPTOR.fields}


def test_sampling_to_wire_leaves_unset_logprobs_and_seed_unset():
    msg = sampling_to_wire(dataclasses.replace(FULL, logprobs=None, seed=None))
    assert not msg.HasField("logprobs") and not msg.HasField("seed")
    zero = sampling_to_wire(dataclasses.replace(FULL, logprobs=0, seed=0))
    assert zero.HasField("logprobs") and zero.logprobs == 0 and zero.HasField("seed") and zero.seed == 0
    # The worker reads the message exactly as before: the decoded bytes say the same.
    assert wpb.SamplingParams.FromString(zero.SerializeToString()) == zero
