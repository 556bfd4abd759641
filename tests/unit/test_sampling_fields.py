"""Every row of the sampling field table (common/sampling_fields.py) through every form the field takes.

A value off its default goes OpenAI body -> llmserve.v1 -> the scheduler's record -> the worker wire -> the worker's
record, and the record through the Redis codec; vLLM's engine protocol maps onto the same llmserve.v1 message.
Defaults agree everywhere a field can be omitted, and an out-of-range value is refused with the field's name.
"""

from __future__ import annotations

import grpc
import pytest

from api_svc.bridge import completion_requests
from api_svc.errors import from_grpc
from api_svc.protocol import CompletionRequest
from common.sampling_fields import BY_NAME, FIELDS, TOKEN_SEQS, SamplingParams
from common.sampling_wire import read, write
from common.tokenizer import Tokenizer
from protos import llmserve_pb2 as pb
from protos import vllm_engine_pb2 as vpb
from protos import worker_pb2 as wpb
from scheduler_svc.core.request import Request
from scheduler_svc.driver.admission import AdmissionError, Limits, bad_words_token_ids, build_requests, check_sampling
from scheduler_svc.driver.worker_client import sampling_to_wire
from scheduler_svc.ledger.codec import final_fields, spec_fields
from scheduler_svc.ledger.store import _decode_request
from scheduler_svc.servers.vllm_engine import _Refused, to_llmserve
from worker_svc.wire import sampling_from_wire

LIMITS = Limits(max_model_len=64, vocab_size=1000, kv_pool_tokens=128, block_size=4)
PROMPT = [1, 2, 3]

# One value off its default per row, as a client sends it (floats exact in float32: the wire's type).
SAMPLE = {
    "temperature": 0.5, "top_k": 7, "top_p": 0.75, "min_p": 0.125, "repetition_penalty": 1.25,
    "presence_penalty": -0.5, "frequency_penalty": 1.5, "seed": (1 << 31) - 1, "ignore_eos": True, "min_tokens": 3,
    "max_tokens": 9, "stop_token_ids": [4, 9], "logprobs": 2, "constraint": {"kind": "regex", "spec": "a+"},
    "logit_bias": {5: -100.0, 7: 2.5}, "bad_words": ["hello world", "Paris"], "prompt_logprobs": 4, "embed": True,
}
# One refused value per row with a limit.
BAD = {
    "temperature": -1.0, "top_k": -2, "top_p": 1.5, "min_p": 2.0, "repetition_penalty": 0.0,
    "presence_penalty": 3.0, "frequency_penalty": -2.5, "max_tokens": 0, "logprobs": 21,
    "logit_bias": {5: 100.5}, "bad_words": ["w"] * 65, "prompt_logprobs": 21,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from worker_svc.model.loader import default_model_path

    return Tokenizer.from_gguf(default_model_path())


def _openai_body(name: str, value) -> CompletionRequest:
    if name == "constraint":
        return CompletionRequest(prompt="x", structured_outputs={value["kind"]: value["spec"]})
    return CompletionRequest(prompt="x", **{BY_NAME[name].public: value})


def _admit(req: pb.GenerateRequest, tokenizer: Tokenizer) -> SamplingParams:
    check_sampling(req.sampling)
    return build_requests(req, PROMPT, LIMITS, "r", tokenizer)[0].sampling


def _record_value(name: str, tokenizer: Tokenizer):
    """What admission makes of SAMPLE[name]."""
    if name == "bad_words":
        return bad_words_token_ids(SAMPLE[name], tokenizer)
    return SAMPLE[name]


def _through_redis(s: SamplingParams) -> SamplingParams:
    r = Request(request_id="r", prompt_ids=PROMPT, sampling=s)
    flat = spec_fields(r) + final_fields(r)
    return _decode_request("r", dict(zip(flat[::2], flat[1::2], strict=True)), b"", b"", "0").sampling


def test_every_row_has_a_sample_and_a_record_field():
    assert set(SAMPLE) == set(BY_NAME)
    assert [f.name for f in FIELDS] == [f.name for f in wpb.SamplingParams.DESCRIPTOR.fields]
    assert set(BAD) == {f.name for f in FIELDS if f.limit is not None or f.max_items is not None} - {"seed",
                                                                                                    "min_tokens"}


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_round_trip(name, tokenizer):
    if name == "embed":  # no public sampling field: the Embed RPC sets it (scheduler_svc/driver/embed.py)
        record = SamplingParams(embed=True, seed=1, max_tokens=1)
    else:
        (req,) = completion_requests(_openai_body(name, SAMPLE[name]), "r")
        record = _admit(req, tokenizer)
    want = _record_value(name, tokenizer)
    assert getattr(record, name) == want
    worker = sampling_from_wire(wpb.SamplingParams.FromString(sampling_to_wire(record).SerializeToString()))
    assert worker == record
    assert getattr(_through_redis(worker), name) == want
    assert _through_redis(worker) == record
    f = BY_NAME[name]
    if f.vllm_name is not None:  # vLLM's protocol maps onto the same llmserve.v1 message
        src = vpb.GenerateRequest(request_id="v", tokenized=vpb.TokenizedInput(input_ids=PROMPT))
        # Words travel as words on both public protocols (the scheduler tokenizes them); the rest as recorded.
        write(src.sampling_params, f.vllm_name, SAMPLE[name] if f.kind == TOKEN_SEQS else want)
        assert getattr(_admit(to_llmserve(src, None), tokenizer), name) == want


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_defaults_are_one_value_everywhere(name, tokenizer):
    f = BY_NAME[name]
    default = f.default
    assert getattr(SamplingParams(), name) == default
    assert getattr(SamplingParams.from_dict({}), name) == default  # a key the Redis record lacks
    (req,) = completion_requests(CompletionRequest(prompt="x", max_tokens=None), "r")
    from_openai = _admit(req, tokenizer)
    from_grpc_ = _admit(pb.GenerateRequest(sampling=pb.SamplingParams()), tokenizer)
    vllm = to_llmserve(vpb.GenerateRequest(request_id="v", tokenized=vpb.TokenizedInput(input_ids=PROMPT)), None)
    from_vllm = _admit(vllm, tokenizer)
    if name == "seed":  # drawn at admission, then kept
        assert all(0 <= s.seed < 1 << 63 for s in (from_openai, from_grpc_, from_vllm))
    elif name == "max_tokens":  # the room the model leaves
        assert from_openai.max_tokens == from_grpc_.max_tokens == from_vllm.max_tokens == 64 - len(PROMPT)
    else:
        assert getattr(from_openai, name) == getattr(from_grpc_, name) == getattr(from_vllm, name) == default
    # The worker wire carries every value; the record of defaults crosses it unchanged.
    record = SamplingParams(seed=5)
    assert sampling_from_wire(sampling_to_wire(record)) == record


@pytest.mark.parametrize("name", sorted(BAD))
def test_out_of_range_is_refused_naming_the_field(name):
    f = BY_NAME[name]
    req = pb.GenerateRequest(sampling=pb.SamplingParams())
    if name == "max_tokens":  # the OpenAI body refuses 0 itself (>= 1)
        req.sampling.max_tokens = BAD[name]
    elif name == "bad_words":  # the OpenAI body refuses a list over the limit itself (api_svc/limits.py)
        req.sampling.bad_words.extend(BAD[name])
    else:
        (req,) = completion_requests(_openai_body(name, BAD[name]), "r")
    with pytest.raises(AdmissionError) as e:
        check_sampling(req.sampling)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{f.public} " in str(e.value)
    http = from_grpc(e.value.code, str(e.value))
    assert http.status == 400 and http.param == f.public, http.message
    if f.vllm_name is None:
        return
    src = vpb.GenerateRequest(request_id="v", tokenized=vpb.TokenizedInput(input_ids=PROMPT))
    try:
        write(src.sampling_params, f.vllm_name, BAD[name])
    except (ValueError, TypeError):
        return  # vLLM's wire type cannot carry it (top_k -2 in a uint32)
    if read(src.sampling_params, f, f.vllm_name) is None:
        return  # a proto3 zero that means unset there (repetition_penalty 0)
    with pytest.raises(_Refused, match=f"sampling_params.{f.vllm_name} "):
        to_llmserve(src, None)


@pytest.mark.parametrize("field, value", [("stop_token_ids", [1000]), ("logit_bias", {1000: 1.0})])
def test_token_ids_outside_the_vocabulary_are_refused(field, value):
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**{field: value}))
    with pytest.raises(AdmissionError, match=f"sampling.{field} contains token id 1000, outside the vocabulary"):
        build_requests(req, PROMPT, LIMITS, "r")


def test_bad_words_are_each_word_with_and_without_a_leading_space(tokenizer):
    seqs = bad_words_token_ids(["hello world"], tokenizer)
    assert seqs[0] == tokenizer.encode(" hello world", add_special_tokens=False)
    assert tokenizer.encode("hello world", add_special_tokens=False) in seqs
    assert len(seqs) == len({tuple(s) for s in seqs}) <= 2


def test_a_compact_json_constraint_keeps_its_flag_on_every_form(tokenizer):
    """structured_outputs.disable_any_whitespace (vLLM's per-request field) rides with the constraint to the worker
    and through Redis; off, the record has no such key (records written before it read back alike)."""
    schema = '{"type": "object"}'
    for flag in (True, False):
        body = CompletionRequest(prompt="x", structured_outputs={"json": schema, "disable_any_whitespace": flag})
        (req,) = completion_requests(body, "r")
        record = _admit(req, tokenizer)
        want = {"kind": "json_schema", "spec": schema, **({"disable_any_whitespace": True} if flag else {})}
        assert record.constraint == want
        worker = sampling_from_wire(wpb.SamplingParams.FromString(sampling_to_wire(record).SerializeToString()))
        assert worker == record and _through_redis(worker) == record
