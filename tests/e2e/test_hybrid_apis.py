"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside attention) behind both public APIs of `llmserve serve`:
the OpenAI-compatible HTTP API driven by the official `openai` SDK (completions and chat, whole and streamed,
n = 2, a json_schema response format) and vLLM's gRPC engine protocol on the scheduler's port. The checkpoint is
written by transformers here with random weights and the bundled model's tokenizer (its vocabulary, its chat
template), so greedy text is compared with transformers' float32 generation; the state-slot usage is scraped
from the API's /metrics beside `vllm:kv_cache_usage_perc`.
"""

from __future__ import annotations

import json
import os
import uuid

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
import transformers

from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster
from tests.support.dashboard_series import samples
from tests.support.random_weights import randomize

PROMPT = "The capital of France is"
MAX_TOKENS = 12
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bundled_model_path):
    from tests.service.test_hybrid_families import COMMON, FAMILIES

    d, f = os.path.split(bundled_model_path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    config_cls, model_cls, fields, _ = FAMILIES["qwen3_5"]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**COMMON, **fields, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}))
    randomize(hf)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large embeddings and head: clear greedy margins
        for name, p in hf.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
    path = tmp_path_factory.mktemp("qwen3_5-apis")
    hf.eval().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), hf, tok


@pytest.fixture(scope="module")
def serve(checkpoint):
    proc = cluster.start_serve(["--model", checkpoint[0], "--device", "cpu", "--num-gpu-blocks-override", 64,
                                "--max-model-len", 512, "--num-state-slots", 8, "--max-num-seqs", 4])
    try:
        yield proc
    finally:
        assert cluster.stop(proc, timeout=30) == 0, proc.log_tail()


@pytest.fixture(scope="module")
def sdk(serve):
    http = f"http://127.0.0.1:{serve.extra['http_port']}"
    client = openai.OpenAI(base_url=http + "/v1", api_key="none", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id, http


def hf_text(checkpoint, ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    _, hf, tok = checkpoint
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                      eos_token_id=None)
    new = out[0, len(ids):].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


def test_completions_whole_streamed_and_n2_equal_transformers(checkpoint, sdk):
    client, model, _ = sdk
    _, expected = hf_text(checkpoint, checkpoint[2].encode(PROMPT))
    greedy = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**greedy)
    assert whole.choices[0].text == expected and whole.usage.completion_tokens == MAX_TOKENS
    streamed = "".join(c.choices[0].text for c in client.completions.create(**greedy, stream=True) if c.choices)
    assert streamed == expected
    two = client.completions.create(**greedy, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert all(c.text == expected for c in two.choices)  # greedy siblings: the state copied to each exactly


def test_chat_whole_and_streamed_equal_transformers_on_the_chat_template(checkpoint, sdk):
    client, model, _ = sdk
    tok = checkpoint[2]
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    _, expected = hf_text(checkpoint, list(ids))
    greedy = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**greedy)
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**greedy, stream=True)
                       if c.choices)
    assert streamed == expected
    two = client.chat.completions.create(**{**greedy, "temperature": 0.8, "seed": 3}, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]


def test_json_schema_response_format_is_valid(sdk):
    client, model, _ = sdk
    for n in (1, 2):
        res = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], max_tokens=48,
            temperature=0.7, seed=11, n=n, extra_body={"structured_outputs": {"disable_any_whitespace": True}},
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
        assert len(res.choices) == n
        for c in res.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_vllm_grpc_engine_protocol_equals_transformers(checkpoint, serve):
    ids = checkpoint[2].encode(PROMPT)
    expected_ids, _ = hf_text(checkpoint, ids)
    sampling = vpb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=True)
    for stream in (False, True):
        req = vpb.GenerateRequest(request_id=uuid.uuid4().hex, stream=stream, sampling_params=sampling)
        req.tokenized.input_ids.extend(ids)
        req.tokenized.original_text = PROMPT
        with grpc.insecure_channel(serve.address) as ch:
            msgs = list(vpb_grpc.VllmEngineStub(ch).Generate(req, timeout=300))
        assert msgs[-1].WhichOneof("response") == "complete"
        assert list(msgs[-1].complete.output_ids) == expected_ids, stream
        if stream:
            assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == expected_ids


def test_state_slot_usage_beside_kv_usage_on_the_api_port(sdk):
    got = {s.name: s.value for s in samples(httpx.get(sdk[2] + "/metrics", timeout=30).text)}
    assert "vllm:kv_cache_usage_perc" in got
    assert 0 <= got["llmserve:state_slot_usage_perc"] <= 1
    assert "llmserve:state_snapshots" in got and "llmserve:state_snapshot_share" in got
