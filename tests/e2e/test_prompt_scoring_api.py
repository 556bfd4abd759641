"""Prompt logprobs and embeddings through the whole stack (redis-server, a float32 worker, the scheduler, the HTTP
API), with the openai SDK, raw HTTP, llmserve.v1 and vLLM's engine protocol, against Hugging Face transformers.

The scheduler's token budget is 32 tokens, so the long prompt is prefilled in chunks; the same prompt sent first
without prompt logprobs puts its blocks in the prefix cache, which a prompt-logprobs request must not use.
"""

from __future__ import annotations

import base64
import time

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster
from tests.support.stack import Stack

BUDGET = 32
LONG = ("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
        "and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat.")
SHORT = "The capital of France is"
TOL = 1e-4


@pytest.fixture(scope="module")
def st():
    stack = Stack(["--dtype", "float32", "--num-gpu-blocks-override", "128", "--max-model-len", "512"],
                  ["--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "8"]).start()
    api = cluster.start_api(stack.address)
    try:
        url = f"http://127.0.0.1:{api.port}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, api.log_tail()
            time.sleep(0.2)
        stack.url = url
        stack.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        stack.model = stack.client.models.list().data[0].id
        yield stack
    finally:
        cluster.stop(api)
        stack.stop()


def kv_free(st, timeout: float = 10.0) -> bool:
    """No block is referenced (cached blocks left in the prefix-cache index are free)."""
    pool = st.driver.core.pool
    deadline = time.monotonic() + timeout
    while pool.num_used and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool.num_used == 0


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is the log-softmax that scores token p + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def hf_hidden(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()


def check_echo(lp: dict, ids: list[int], ref: torch.Tensor, top: int, text) -> None:
    """OpenAI's completions logprobs of an echoed prompt (then one generated token) against the reference."""
    n = len(ids)
    assert lp["tokens"][:n] == [text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:n], dtype=np.float64)
    want = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).double().numpy()
    assert np.abs(got - want).max() < TOL
    for p in range(1, n):
        want_top = ref[p - 1].topk(top)
        got_top = lp["top_logprobs"][p]
        assert sorted(got_top.values(), reverse=True) == pytest.approx(want_top.values.tolist(), abs=TOL)
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets[:-1], offsets[1:], lp["tokens"][:-1], strict=True))
    assert len(lp["tokens"]) == n + 1, "the prompt's tokens, then the generated one"


@pytest.fixture(scope="module")
def long_ids(hf_tokenizer):
    ids = hf_tokenizer.encode(LONG)
    assert len(ids) > BUDGET, "the long prompt must be chunked"
    return ids


@pytest.fixture(scope="module")
def token_text(hf_tokenizer):
    return lambda t: hf_tokenizer.decode([t])


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_echo_logprobs_match_hf(st, hf_model, hf_tokenizer, long_ids, token_text, prompt):
    ids = long_ids if prompt == "long" else hf_tokenizer.encode(SHORT)
    r = st.client.completions.create(model=st.model, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs.model_dump()
    check_echo(lp, ids, hf_logprobs(hf_model, ids), 2, token_text)
    assert r.choices[0].text.startswith(hf_tokenizer.decode(ids))
    assert kv_free(st)


def test_prefix_cache_hit_still_scores_every_token(st, hf_model, long_ids, token_text):
    def hits() -> float:
        return sum(s.value for m in st.driver.metrics.prefix_hits.collect() for s in m.samples
                   if s.name.endswith("_total"))

    plain = dict(model=st.model, prompt=long_ids, max_tokens=1, temperature=0)
    st.client.completions.create(**plain)  # its full blocks enter the prefix-cache index
    before = hits()
    st.client.completions.create(**plain)
    after = hits()
    assert after > before, "a plain repeat is served from the cache"
    r = st.client.completions.create(**plain, echo=True, logprobs=1)
    check_echo(r.choices[0].logprobs.model_dump(), long_ids, hf_logprobs(hf_model, long_ids), 1, token_text)
    assert hits() == after, "a prompt-logprobs request computes its whole prompt"
    assert kv_free(st)


def test_streamed_echo_carries_the_prompt_logprobs(st, hf_model, hf_tokenizer, long_ids, token_text):
    chunks = list(st.client.completions.create(model=st.model, prompt=LONG, echo=True, logprobs=1, max_tokens=3,
                                               temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == LONG
    lp = first.logprobs.model_dump()
    ids = hf_tokenizer.encode(LONG)
    assert lp["tokens"] == [token_text(t) for t in ids]
    ref = hf_logprobs(hf_model, ids)
    got = np.array(lp["token_logprobs"][1:])
    assert np.abs(got - ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).numpy()).max() < TOL
    assert "".join(c.choices[0].text for c in chunks[1:]), "then the generated text"
    assert kv_free(st)


def test_vllm_prompt_logprobs_field(st, hf_model, hf_tokenizer):
    ids = hf_tokenizer.encode(SHORT)
    ref = hf_logprobs(hf_model, ids)
    r = httpx.post(st.url + "/v1/completions", json={"model": st.model, "prompt": SHORT, "max_tokens": 2,
                                                      "temperature": 0, "prompt_logprobs": 2}, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert abs(entry["logprob"] - float(ref[p - 1, ids[p]])) < TOL
        assert len(plp[p]) in (2, 3)  # the top 2, plus the token itself when it is not among them
    assert r["choices"][0]["logprobs"] is None, "prompt_logprobs alone asks for no output logprobs"
    chat = httpx.post(st.url + "/v1/chat/completions", json={
        "model": st.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 0}, timeout=60).json()
    rendered = httpx.post(st.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    chat_ids = rendered["tokens"]
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    chat_ref = hf_logprobs(hf_model, chat_ids)
    last = chat["prompt_logprobs"][-1][str(chat_ids[-1])]["logprob"]
    assert abs(last - float(chat_ref[-1, chat_ids[-1]])) < TOL
    assert kv_free(st)


def test_grpc_and_vllm_engine_protocol(st, hf_model, hf_tokenizer):
    ids = hf_tokenizer.encode(SHORT)
    ref = hf_logprobs(hf_model, ids)
    with grpc.insecure_channel(st.address) as ch:
        msgs = list(pb_grpc.LLMServeStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)),
            timeout=60))
        assert list(msgs[0].prompt_token_ids) == ids
        got = [lp.logprob for lp in msgs[0].prompt_logprobs]
        assert np.abs(np.array(got) - ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).numpy()).max() < TOL
        assert all(len(lp.top) == 1 for lp in msgs[0].prompt_logprobs)
        assert not any(m.prompt_token_ids for m in msgs[1:]), "sent once"

        vllm = vpb_grpc.VllmEngineStub(ch)
        for stream in (False, True):
            out = list(vllm.Generate(vpb.GenerateRequest(
                request_id=f"v-{stream}", tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                sampling_params=vpb.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)), timeout=60))
            done = out[-1].complete
            inp = done.input_logprobs
            assert list(inp.token_ids) == ids and not inp.token_logprobs[0].HasField("value")
            assert abs(inp.token_logprobs[1].value - float(ref[0, ids[1]])) < TOL
            if stream:
                assert list(out[0].chunk.input_logprobs.token_ids) == ids
        with pytest.raises(grpc.RpcError) as e:
            vllm.Generate(vpb.GenerateRequest(text="x", sampling_params=vpb.SamplingParams(prompt_logprobs=-1)),
                          timeout=30).next()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.prompt_logprobs" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.LLMServeStub(ch).Generate(pb.GenerateRequest(
                text="x", sampling=pb.SamplingParams(prompt_logprobs=21)), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.prompt_logprobs" in e.value.details()
    assert kv_free(st)


@pytest.mark.parametrize("value", [-1, 21, "many", 1.5, [1]])
def test_bad_prompt_logprobs_is_400(st, value):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(st.url + path, json={**body, "model": st.model, "prompt_logprobs": value}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_logprobs", r.text


# ---- embeddings ------------------------------------------------------------------------------------------------


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(np.array(a), dtype=torch.float32), b, dim=0))


def test_embeddings_match_hf_every_input_form(st, hf_model, hf_tokenizer, long_ids):
    short_ids = hf_tokenizer.encode(SHORT)
    want_short, want_long = hf_hidden(hf_model, short_ids)[-1], hf_hidden(hf_model, long_ids)[-1]
    c = st.client
    one = c.embeddings.create(model=st.model, input=SHORT, encoding_format="float")
    assert one.usage.prompt_tokens == len(short_ids) == one.usage.total_tokens
    assert cosine(one.data[0].embedding, want_short) >= 0.9999
    assert abs(np.linalg.norm(one.data[0].embedding) - 1) < 1e-4, "L2-normalised"
    many = c.embeddings.create(model=st.model, input=[SHORT, LONG], encoding_format="float")  # LONG: chunked
    assert [d.index for d in many.data] == [0, 1]
    assert cosine(many.data[0].embedding, want_short) >= 0.9999
    assert cosine(many.data[1].embedding, want_long) >= 0.9999
    assert many.usage.prompt_tokens == len(short_ids) + len(long_ids)
    ids = c.embeddings.create(model=st.model, input=short_ids, encoding_format="float")
    assert cosine(ids.data[0].embedding, want_short) >= 0.9999
    lists = c.embeddings.create(model=st.model, input=[short_ids, long_ids])  # the SDK asks for base64 and decodes
    assert cosine(lists.data[1].embedding, want_long) >= 0.9999
    raw = httpx.post(st.url + "/v1/embeddings", json={"input": SHORT, "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (hf_model.config.hidden_size,) and cosine(vec, want_short) >= 0.9999
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert kv_free(st)


def test_embeddings_share_steps_with_generation(st, hf_model, long_ids):
    """A long generation runs while embeddings come and go; the pool is empty afterwards."""
    import threading

    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("gen", st.client.completions.create(
        model=st.model, prompt=LONG, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})))
    t.start()
    vectors = [st.client.embeddings.create(model=st.model, input=long_ids, encoding_format="float")
               for _ in range(3)]
    t.join()
    assert out["gen"].usage.completion_tokens == 40
    want = hf_hidden(hf_model, long_ids)[-1]
    assert all(cosine(v.data[0].embedding, want) >= 0.9999 for v in vectors)
    assert kv_free(st)


def test_embed_rpcs(st, hf_model, hf_tokenizer):
    ids = hf_tokenizer.encode(SHORT)
    want = hf_hidden(hf_model, ids)[-1]
    with grpc.insecure_channel(st.address) as ch:
        r = pb_grpc.LLMServeStub(ch).Embed(pb.EmbedRequest(text=SHORT), timeout=60)
        assert r.prompt_tokens == len(ids) and cosine(list(r.embedding), want) >= 0.9999
        v = vpb_grpc.VllmEngineStub(ch).Embed(vpb.EmbedRequest(request_id="e1", tokenized=vpb.TokenizedInput(
            input_ids=ids)), timeout=60)
        assert v.embedding_dim == hf_model.config.hidden_size and v.prompt_tokens == len(ids)
        assert cosine(list(v.embedding), want) >= 0.9999
        for call, req, word in (
                (pb_grpc.LLMServeStub(ch).Embed, pb.EmbedRequest(), "prompt"),
                (pb_grpc.LLMServeStub(ch).Embed, pb.EmbedRequest(token_ids=pb.TokenIds(ids=[10 ** 9])), "token_ids"),
                (vpb_grpc.VllmEngineStub(ch).Embed, vpb.EmbedRequest(request_id="e2"), "tokenized.input_ids")):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert word in e.value.details()
    assert kv_free(st)


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"), ({"input": [[1, -2]]}, "input"),
    ({"input": ""}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": ["x"] * 2049}, "input"),
    ({"input": "word " * 600}, "input"), ({"input": "x", "model": "other"}, "model"),
])
def test_bad_embeddings_are_400(st, body, param):
    r = httpx.post(st.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    assert kv_free(st)
