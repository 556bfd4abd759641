"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on the scheduler's port, with a client generated from
protos/vllm_engine.proto: redis-server, a worker with the bundled model and a scheduler, one stack for the module.

Every output is compared with llmserve.v1's own Generate for the same request on the same scheduler.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import uuid
import zipfile

import grpc
import pytest

from llmserve.bench.metrics import metric_sum, scrape
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster

MAX_MODEL_LEN = 512


class Stack:
    def __init__(self, redis_url: str):
        self.worker = cluster.start_worker(["--num-gpu-blocks-override", "128", "--max-model-len", str(MAX_MODEL_LEN)])
        self.metrics_port = cluster.free_port()
        self.scheduler = cluster.start_scheduler(redis_url, self.worker, ["--metrics-port", self.metrics_port,
                                                                          "--max-num-batched-tokens", "256"])
        self.address = f"127.0.0.1:{self.scheduler.port}"
        cluster.wait_healthy(self.address, proc=self.scheduler)
        self.channel = grpc.insecure_channel(self.address)
        self.vllm = vpb_grpc.VllmEngineStub(self.channel)
        self.llmserve = pb_grpc.LLMServeStub(self.channel)

    def reference(self, ids: list[int], max_tokens: int, n: int = 1, seed: int | None = None) -> list[list[int]]:
        """llmserve.v1's tokens for the same prompt (one list per sequence)."""
        s = pb.SamplingParams(temperature=0 if seed is None else 1, max_tokens=max_tokens, ignore_eos=True, n=n)
        if seed is not None:
            s.seed = seed
        out: list[list[int]] = [[] for _ in range(n)]
        for msg in self.llmserve.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=s)):
            out[msg.index].extend(msg.token_ids)
        return out

    def hits(self) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"), "vllm:prefix_cache_hits_total")


def _tokenizer(st: Stack):
    from common.tokenizer import load_tokenizer
    info = st.llmserve.GetModelInfo(pb.GetModelInfoRequest())
    return load_tokenizer(info.model_path)


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    stack = Stack(redis_server)
    yield stack
    stack.channel.close()
    cluster.stop_all()


def greedy(max_tokens: int = 8, **kw) -> vpb.SamplingParams:
    return vpb.SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                 "skip_special_tokens": True, **kw})


def generate(st: Stack, ids: list[int] | None = None, text: str | None = None, stream: bool = False,
             sampling: vpb.SamplingParams | None = None, request_id: str = "") -> list[vpb.GenerateResponse]:
    req = vpb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, stream=stream,
                              sampling_params=sampling or greedy())
    if ids is not None:
        req.tokenized.input_ids.extend(ids)
        req.tokenized.original_text = "ids"
    else:
        req.text = text
    return list(st.vllm.Generate(req, timeout=120))


PROMPT = "The capital of France is"


def test_non_streaming_greedy_equals_llmserve(st):
    ids = _tokenizer(st).encode(PROMPT)
    msgs = generate(st, ids)
    assert len(msgs) == 1 and msgs[0].WhichOneof("response") == "complete"
    done = msgs[0].complete
    assert list(done.output_ids) == st.reference(ids, 8)[0]
    assert done.finish_reason == "length" and done.prompt_tokens == len(ids) and done.completion_tokens == 8
    assert done.index == 0


def test_streaming_chunks_then_complete(st):
    ids = _tokenizer(st).encode("def fibonacci(n):")
    msgs = generate(st, ids, stream=True, sampling=greedy(12))
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    streamed = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    ref = st.reference(ids, 12)[0]
    assert streamed == ref and list(msgs[-1].complete.output_ids) == ref
    counts = [m.chunk.completion_tokens for m in msgs[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(m.chunk.prompt_tokens == len(ids) for m in msgs[:-1])


def test_text_input_equals_tokenized(st):
    ids = _tokenizer(st).encode(PROMPT)
    by_text = generate(st, text=PROMPT)[0].complete
    assert list(by_text.output_ids) == list(generate(st, ids)[0].complete.output_ids)
    assert by_text.prompt_tokens == len(ids)


def test_n_with_index_and_seed(st):
    ids = _tokenizer(st).encode("Once upon a time")
    s = vpb.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=7)
    msgs = generate(st, ids, stream=True, sampling=s)
    completes = {m.complete.index: list(m.complete.output_ids) for m in msgs if m.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for m in msgs:
        if m.HasField("chunk"):
            streamed[m.chunk.index].extend(m.chunk.token_ids)
    assert streamed == completes
    assert [completes[i] for i in range(3)] == st.reference(ids, 6, n=3, seed=7)


def test_logprobs(st):
    ids = _tokenizer(st).encode(PROMPT)
    done = generate(st, ids, sampling=greedy(4, logprobs=3))[0].complete
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids) and len(lp.token_logprobs) == 4
    for i, top in enumerate(lp.top_logprobs):
        assert len(top.values) == 3 and top.token_ids[0] == done.output_ids[i]  # greedy: the sampled one is the top
        assert all(v <= 0 for v in top.values)
    assert not generate(st, ids)[0].complete.HasField("output_logprobs")


def test_cached_tokens_from_prefix_cache(st):
    tok = _tokenizer(st)
    ids = tok.encode("A long shared preamble about the history of the city of Paris, its rivers and its bridges. "
                     * 3)[:64]
    first = generate(st, ids)[0].complete
    before = st.hits()
    second = generate(st, ids)[0].complete
    assert second.cached_tokens >= 48 and second.cached_tokens <= len(ids)
    assert first.cached_tokens < second.cached_tokens
    assert st.hits() - before == second.cached_tokens
    assert list(first.output_ids) == list(second.output_ids)


def test_stop_token_and_stop_string(st):
    ids = _tokenizer(st).encode(PROMPT)
    ref = st.reference(ids, 8)[0]
    done = generate(st, ids, sampling=greedy(8, stop_token_ids=[ref[2]]))[0].complete
    assert done.finish_reason == "stop" and list(done.output_ids) == ref[:3] and done.matched_token_id == ref[2]
    text = _tokenizer(st).decode(ref[:4])
    stop = text.strip().split()[-1]
    done = generate(st, ids, sampling=greedy(8, stop=[stop]))[0].complete
    assert done.finish_reason == "stop" and done.matched_stop_str == stop


def _llmserve_greedy(st: Stack, text: str, max_tokens: int, **kw) -> tuple[list[int], str]:
    s = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    ids, out = [], ""
    for msg in st.llmserve.Generate(pb.GenerateRequest(text=text, sampling=s), timeout=120):
        ids.extend(msg.token_ids)
        out += msg.text
    return ids, out


def test_logit_bias_forces_and_bans_over_both_grpc_apis(st):
    ids = _tokenizer(st).encode(PROMPT)
    ref = st.reference(ids, 6)[0]
    forced = next(t for t in range(100, 10**4) if t not in ref)
    assert _llmserve_greedy(st, PROMPT, 6, logit_bias={forced: 100})[0] == [forced] * 6
    vllm = generate(st, ids, sampling=greedy(6, logit_bias={forced: 100.0}))[0].complete
    assert list(vllm.output_ids) == [forced] * 6
    # Banning the greedy first token: both protocols pick another, the same one.
    banned = _llmserve_greedy(st, PROMPT, 6, logit_bias={ref[0]: -100})[0]
    assert banned[0] != ref[0] and ref[0] not in banned
    assert list(generate(st, ids, sampling=greedy(6, logit_bias={ref[0]: -100.0}))[0].complete.output_ids) == banned


def test_bad_words_never_appear_in_greedy_output(st):
    _, text = _llmserve_greedy(st, PROMPT, 16)
    word = max(text.split(), key=len).strip(".,;:!?\"'")  # a word greedy decoding writes
    assert len(word) >= 3, text
    ids, banned_text = _llmserve_greedy(st, PROMPT, 16, bad_words=[word])
    assert word not in banned_text and len(ids) == 16, (word, text, banned_text)
    # vLLM's protocol carries the words too: the same tokens as over llmserve.v1.
    vllm = generate(st, _tokenizer(st).encode(PROMPT), sampling=greedy(16, bad_words=[word]))[0].complete
    assert list(vllm.output_ids) == ids
    for bad in (["w"] * 65, ["x" * 257], [" "]):  # the limits: 64 words, 256 bytes each, not only spaces
        with pytest.raises(grpc.RpcError) as e:
            _llmserve_greedy(st, PROMPT, 4, bad_words=bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.bad_words" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _llmserve_greedy(st, PROMPT, 4, logit_bias={1: -101})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logit_bias" in e.value.details()


def test_truncate_prompt_tokens(st):
    ids = _tokenizer(st).encode("one two three four five six seven eight nine ten")
    done = generate(st, ids, sampling=greedy(4, truncate_prompt_tokens=5))[0].complete
    assert done.prompt_tokens == 5
    assert list(done.output_ids) == st.reference(ids[-5:], 4)[0]


def _refusal(st: Stack, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(st, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value


@pytest.mark.parametrize("sampling, field", [
    # Constraints that do not compile (the valid ones run: tests/e2e/test_structured_outputs.py).
    (greedy(json_schema='{"type": "objectx"}'), "sampling_params.json_schema"),
    (greedy(regex="[a-z"), "sampling_params.regex"),
    (greedy(grammar="root ::= undefined_rule"), "sampling_params.grammar"),
    (greedy(structural_tag="{}"), "sampling_params.structural_tag"),
    (greedy(choice=vpb.ChoiceConstraint()), "sampling_params.choice"),
    (greedy(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),  # -1 (the whole vocabulary): refused
    (greedy(logit_bias={5: 100.5}), "sampling_params.logit_bias"),
    (greedy(logit_bias={10**7: 1.0}), "sampling_params.logit_bias"),
    (greedy(bad_words=["x" * 257]), "sampling_params.bad_words"),
    (greedy(logprobs=-1), "sampling_params.logprobs"),
    (greedy(logprobs=21), "sampling_params.logprobs"),
    (greedy(seed=-1), "sampling_params.seed"),
    (greedy(0), "sampling_params.max_tokens"),
    (greedy(temperature=-1), "sampling_params.temperature"),
    (greedy(top_p=1.5), "sampling_params.top_p"),
    (greedy(n=17), "sampling_params.n"),
    (greedy(truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens"),
    (greedy(stop_token_ids=[10**7]), "sampling_params.stop_token_ids"),
])
def test_invalid_sampling_names_the_field(st, sampling, field):
    err = _refusal(st, ids=[1, 2, 3], sampling=sampling)
    assert field in err.details()


def test_invalid_requests_name_the_field(st):
    assert "tokenized.input_ids" in _refusal(st, ids=[10**7]).details()
    assert "max_model_len" in _refusal(st, ids=[5] * MAX_MODEL_LEN).details()
    with pytest.raises(grpc.RpcError) as e:
        list(st.vllm.Generate(vpb.GenerateRequest(request_id="x", sampling_params=greedy())))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in e.value.details()
    for req, field in [
        (vpb.GenerateRequest(kv_transfer_params=vpb.KvTransferParams(remote_host="h")), "kv_transfer_params"),
        (vpb.GenerateRequest(kv_transfer_params_json="{}"), "kv_transfer_params"),
        (vpb.GenerateRequest(mm_inputs=vpb.MultimodalInputs()), "mm_inputs"),
        (vpb.GenerateRequest(data_parallel_rank=1), "data_parallel_rank"),
    ]:
        req.tokenized.input_ids.extend([1, 2])
        with pytest.raises(grpc.RpcError) as e:
            list(st.vllm.Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    # still serving
    assert generate(st, [1, 2, 3])[0].complete.completion_tokens == 8


def test_abort_several_ids_and_server_info(st):
    ids = _tokenizer(st).encode(PROMPT)
    sent = time.time()
    calls = [st.vllm.Generate(vpb.GenerateRequest(request_id=f"ab-{i}", stream=True, sampling_params=greedy(400),
                                                  tokenized=vpb.TokenizedInput(input_ids=ids)))
             for i in range(2)]
    calls.append(st.vllm.Generate(vpb.GenerateRequest(request_id="ab-n", stream=True,
                                                      sampling_params=greedy(400, n=2),
                                                      tokenized=vpb.TokenizedInput(input_ids=ids))))
    for c in calls:  # each has started
        assert next(c).HasField("chunk")
    assert st.vllm.GetServerInfo(vpb.GetServerInfoRequest()).active_requests == 4
    st.vllm.Abort(vpb.AbortRequest(request_ids=["ab-0", "ab-1", "ab-n", "unknown"]))
    for c in calls:
        finishes = [m.complete.finish_reason for m in c if m.HasField("complete")]
        assert finishes and set(finishes) == {"abort"}
    deadline = time.monotonic() + 10
    while st.vllm.GetServerInfo(vpb.GetServerInfoRequest()).active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    info = st.vllm.GetServerInfo(vpb.GetServerInfoRequest())
    assert info.active_requests == 0 and not info.is_paused and info.uptime_seconds > 0
    assert sent <= info.last_receive_timestamp <= time.time()  # set by the Generate calls above


def test_health_model_info_loads(st):
    h = st.vllm.HealthCheck(vpb.HealthCheckRequest())
    assert h.healthy
    m = st.vllm.GetModelInfo(vpb.GetModelInfoRequest())
    ref = st.llmserve.GetModelInfo(pb.GetModelInfoRequest())
    assert m.is_generation and m.max_context_length == MAX_MODEL_LEN and m.vocab_size == ref.vocab_size
    assert m.served_model_name == ref.model_name and m.model_path == ref.model_path and m.eos_token_ids
    loads = st.vllm.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].num_total_reqs == 0
    assert loads.loads[0].max_total_num_tokens == ref.num_blocks * ref.block_size
    assert 0 <= loads.loads[0].token_usage < 1


def test_get_tokenizer_zip(st):
    chunks = list(st.vllm.GetTokenizer(vpb.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = set(z.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
        config = json.loads(z.read("tokenizer_config.json"))
        from tokenizers import Tokenizer
        rebuilt = Tokenizer.from_str(z.read("tokenizer.json").decode())
    tok = _tokenizer(st)
    assert config["chat_template"] == tok.chat_template
    assert rebuilt.encode("Hello <|im_start|>world 123").ids == tok.encode("Hello <|im_start|>world 123")
    again = b"".join(c.data for c in st.vllm.GetTokenizer(vpb.GetTokenizerRequest()))
    assert again == data
