"""The OpenAI-compatible HTTP API (`llmserve api`) with real processes: redis-server, a worker with the bundled model,
a scheduler and the API process, driven by the official `openai` SDK (and by raw HTTP where the wire format is the
point: the requests `vllm bench serve` sends).

One stack for the module; the scheduler is small on purpose (4 running sequences, 2 queued, a 3 s queue timeout) so
that 429 and 504 can be provoked. The scheduler kill test comes last: it restarts the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid

import httpx
import openai
import pytest

from common.client import Client
from llmserve.bench.metrics import metric_sum, scrape
from llmserve.client import stream as grpc_stream
from protos import llmserve_pb2 as pb
from tests.support import cluster

API_KEY = "sk-test-key"
SCHEDULER_ARGS = ["--max-num-seqs", "4", "--max-num-queued-requests", "2", "--queue-timeout", "3",
                  "--lease-ttl-ms", "2000", "--max-num-batched-tokens", "256"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


class Stack:
    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.worker = cluster.start_worker(["--num-gpu-blocks-override", "256", "--max-model-len", "1024"])
        self.sched_port, self.metrics_port = cluster.free_port(), cluster.free_port()
        self.namespace = cluster.new_namespace("openai")
        self.start_scheduler()
        # An API in front of nothing (503), started alongside the real one.
        self.orphan = cluster.start_api(f"127.0.0.1:{cluster.free_port()}", wait=False)
        self.api = cluster.start_api(self.sched_addr, ["--api-key", API_KEY, "--reattach-timeout", "60"])
        cluster.wait_ready(self.orphan)
        self.url = f"http://127.0.0.1:{self.api.port}"
        deadline = time.monotonic() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, self.api.log_tail()
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    @property
    def sched_addr(self) -> str:
        return f"127.0.0.1:{self.sched_port}"

    def start_scheduler(self, args=SCHEDULER_ARGS) -> None:
        self.scheduler = cluster.start_scheduler(
            self.redis_url, self.worker, [*args, "--port", self.sched_port, "--metrics-port", self.metrics_port],
            namespace=self.namespace)
        cluster.wait_healthy(self.sched_addr, proc=self.scheduler)

    def kv_usage(self) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"), "vllm:kv_cache_usage_perc")

    def wait_kv_free(self, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while (usage := self.kv_usage()) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return usage

    def post(self, path: str, body, headers: dict | None = None, key: str | None = API_KEY) -> httpx.Response:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers={**h, **(headers or {})}, timeout=60)


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    stack = Stack(redis_server)
    yield stack
    cluster.stop_all()


def greedy(**kw) -> dict:
    return {"temperature": 0, "max_tokens": 8, **kw}


# ---- completions and chat ---------------------------------------------------------------------------------------

def test_models_health_version_metrics(st):
    models = httpx.get(st.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert models["object"] == "list" and models["data"][0]["id"] == st.model
    assert models["data"][0]["max_model_len"] == 1024
    assert httpx.get(st.url + "/version").json()["version"]
    metrics = httpx.get(st.url + "/metrics").text
    assert 'http_requests_total{handler="/v1/models",method="GET",status="200"}' in metrics
    assert "http_time_to_first_byte_seconds_bucket" in metrics


def test_completion_greedy_equals_grpc_and_usage(st):
    for prompt in PROMPTS:
        r = st.client.completions.create(model=st.model, prompt=prompt, extra_body={"ignore_eos": True},
                                         **greedy(max_tokens=12))
        req = pb.GenerateRequest(request_id=f"grpc-{abs(hash(prompt))}", text=prompt,
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        res = grpc_stream(req, st.sched_addr)
        assert r.choices[0].text == "".join(res.text[0])
        assert r.choices[0].finish_reason == "length"
        ids = st.post("/tokenize", {"prompt": prompt}).json()
        assert r.usage.prompt_tokens == ids["count"] == res.usage[0].prompt_tokens
        assert r.usage.completion_tokens == 12 and r.usage.total_tokens == ids["count"] + 12


def test_completion_streaming_equals_whole(st):
    whole = st.client.completions.create(model=st.model, prompt=PROMPTS[0], **greedy(max_tokens=10))
    chunks = list(st.client.completions.create(model=st.model, prompt=PROMPTS[0], stream=True,
                                               stream_options={"include_usage": True}, **greedy(max_tokens=10)))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_token_id_prompts_and_prompt_lists(st):
    ids = st.post("/tokenize", {"prompt": PROMPTS[1]}).json()["tokens"]
    assert st.post("/detokenize", {"tokens": ids}).json()["prompt"] == PROMPTS[1]
    by_text = st.client.completions.create(model=st.model, prompt=PROMPTS[1], **greedy())
    by_ids = st.client.completions.create(model=st.model, prompt=ids, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = st.client.completions.create(model=st.model, prompt=[ids, ids[:3]], **greedy())
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == by_text.choices[0].text
    assert several.usage.prompt_tokens == len(ids) + 3
    echo = st.client.completions.create(model=st.model, prompt=PROMPTS[1], echo=True, **greedy())
    assert echo.choices[0].text == PROMPTS[1] + by_text.choices[0].text


def test_n2_seeded_sampling_is_reproduced(st):
    kw = {"temperature": 1.0, "seed": 1234, "max_tokens": 8, "n": 2}
    a = st.client.completions.create(model=st.model, prompt=PROMPTS[2], **kw)
    b = st.client.completions.create(model=st.model, prompt=PROMPTS[2], **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert a.usage.prompt_tokens == st.post("/tokenize", {"prompt": PROMPTS[2]}).json()["count"]  # once, not n times
    assert 2 <= a.usage.completion_tokens <= 16
    # Streamed, the two choices interleave with their index and add up to the same texts.
    texts = ["", ""]
    for chunk in st.client.completions.create(model=st.model, prompt=PROMPTS[2], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]
    chat_kw = {"temperature": 1.0, "seed": 99, "max_tokens": 8, "n": 2}
    msgs = [{"role": "user", "content": "Tell me a word."}]
    x = st.client.chat.completions.create(model=st.model, messages=msgs, **chat_kw)
    y = st.client.chat.completions.create(model=st.model, messages=msgs, **chat_kw)
    assert [c.message.content for c in x.choices] == [c.message.content for c in y.choices]


def test_logprobs(st):
    r = st.client.completions.create(model=st.model, prompt=PROMPTS[0], logprobs=2, **greedy(max_tokens=5))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(t) for top, t in
               zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # greedy: the sampled token is the top one
    assert lp.text_offset[0] == 0
    c = st.client.chat.completions.create(model=st.model, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=3, **greedy(max_tokens=5))
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert "".join(t.token for t in content) == c.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def _token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]  # vLLM's return_token_ids


def test_logit_bias_forces_and_bans_a_greedy_token(st):
    ids = {"return_token_ids": True}
    ref = _token_ids(st.client.completions.create(model=st.model, prompt=PROMPTS[0], extra_body=ids,
                                                  **greedy(max_tokens=6)).choices[0])
    forced = next(t for t in range(100, 10**4) if t not in ref)
    r = st.client.completions.create(model=st.model, prompt=PROMPTS[0], logit_bias={str(forced): 100},
                                     extra_body={**ids, "ignore_eos": True}, **greedy(max_tokens=6))
    assert _token_ids(r.choices[0]) == [forced] * 6
    assert r.choices[0].text == st.post("/detokenize", {"tokens": [forced] * 6}).json()["prompt"]
    banned = st.client.completions.create(model=st.model, prompt=PROMPTS[0], logit_bias={str(ref[0]): -100},
                                          extra_body=ids, **greedy(max_tokens=6))
    assert ref[0] not in _token_ids(banned.choices[0])
    # Chat carries it the same way.
    msgs = [{"role": "user", "content": "Say hello."}]
    chat = st.client.chat.completions.create(model=st.model, messages=msgs, logit_bias={str(forced): 100},
                                             extra_body={**ids, "ignore_eos": True}, **greedy(max_tokens=3))
    assert _token_ids(chat.choices[0]) == [forced] * 3


def test_bad_words_never_appear_in_greedy_output(st):
    for prompt in PROMPTS:
        text = st.client.completions.create(model=st.model, prompt=prompt, **greedy(max_tokens=16)).choices[0].text
        word = max(text.split(), key=len).strip(".,;:!?()\"'")
        if len(word) < 3:
            continue
        banned = st.client.completions.create(model=st.model, prompt=prompt, extra_body={"bad_words": [word]},
                                              **greedy(max_tokens=16)).choices[0].text
        assert word in text and word not in banned, (prompt, word, text, banned)


def test_stop_strings(st):
    full = st.client.completions.create(model=st.model, prompt=PROMPTS[2], **greedy(max_tokens=16)).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = full[:full.index(stop)]
    r = st.client.completions.create(model=st.model, prompt=PROMPTS[2], stop=stop, **greedy(max_tokens=16))
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    kept = st.client.completions.create(model=st.model, prompt=PROMPTS[2], stop=[stop, "\x00never"],
                                        extra_body={"include_stop_str_in_output": True}, **greedy(max_tokens=16))
    assert kept.choices[0].text == cut + stop
    streamed = "".join(c.choices[0].text for c in st.client.completions.create(
        model=st.model, prompt=PROMPTS[2], stop=stop, stream=True, **greedy(max_tokens=16)) if c.choices)
    assert streamed == cut


def test_chat_template_as_generate_chat(st):
    """The chat template is the one `llmserve generate --chat` applies: the same prompt tokens, the same text."""
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--server", st.sched_addr, "--chat",
                          "--system", "You are terse.", "--json", "--max-tokens", "10", "--temperature", "0",
                          "Name a colour."], capture_output=True, text=True, timeout=60, cwd=cluster.ROOT)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    r = st.client.chat.completions.create(model=st.model, messages=messages, **greedy(max_tokens=10))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == summary["text"]
    assert r.usage.prompt_tokens == summary["usage"]["prompt_tokens"]
    assert st.post("/tokenize", {"messages": messages}).json()["count"] == r.usage.prompt_tokens
    chunks = list(st.client.chat.completions.create(model=st.model, messages=messages, stream=True,
                                                    **greedy(max_tokens=10)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == summary["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # Every role, with the tool's answer in the conversation.
    roles = st.client.chat.completions.create(model=st.model, messages=[
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"}], **greedy(max_tokens=2))
    assert roles.choices[0].finish_reason in ("length", "stop")


def test_request_id_header(st):
    r = st.post("/v1/completions", {"prompt": "Hello", **greedy(max_tokens=2)}, headers={"x-request-id": "my-req-1"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-my-req-1"


# ---- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, limit", [
    ({"top_p": 7}, "top_p", "(0, 1]"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"max_tokens": 5000}, "max_tokens", "max_model_len 1024"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"n": 17}, "n", "<= 16"),
    ({"stop": ["x"] * 17}, "stop", "16"),
    ({"logprobs": 21}, "logprobs", "<= 20"),
    ({"prompt": [0, 10**6]}, "prompt", "vocabulary [0, "),
    ({"prompt": [0, -1]}, "prompt", "greater than or equal to 0"),
    ({"prompt": [[1, 2], [10**6]]}, "prompt", "vocabulary [0, "),  # one bad prompt of two: the other is aborted
    ({"prompt": "x " * 1100}, "prompt", "max_model_len 1024"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias", "vocabulary"),
    ({"bad_words": ["w"] * 65}, "bad_words", "64"),
])
def test_bad_completion_fields_are_400_naming_the_field(st, body, param, limit):
    r = st.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and limit in err["message"], err
    assert err["type"] == "BadRequestError"


def test_errors_through_the_sdk_and_the_server_keeps_serving(st):
    with pytest.raises(openai.BadRequestError) as e:
        st.client.chat.completions.create(model=st.model, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        st.client.chat.completions.create(model=st.model, messages=[])
    assert e.value.response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        st.client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=st.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(st.url + "/v1/models").status_code == 401  # no key at all
    bad_json = httpx.post(st.url + "/v1/completions", content=b"{nope", headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    missing = st.post("/v1/completions", {"max_tokens": 2})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    assert st.client.completions.create(model=st.model, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    assert st.wait_kv_free() == 0


def test_no_scheduler_is_503_with_retry_after(st):
    r = httpx.post(f"http://127.0.0.1:{st.orphan.port}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(f"http://127.0.0.1:{st.orphan.port}/health").status_code == 503


def test_full_queue_is_429_and_queue_timeout_is_504(st):
    """4 long streams fill the running batch, 2 more fill the queue (and time out after --queue-timeout 3 s:
    504), the next one finds it full: 429. Closing the streams frees every KV block."""
    long = {"prompt": "Count: 1, 2, 3,", "max_tokens": 900, "temperature": 0, "stream": True}
    streams = []
    try:
        for _ in range(4):  # running: each answered its first token
            s = st.client.completions.create(model=st.model, extra_body={"ignore_eos": True}, **long)
            next(iter(s))
            streams.append(s)
        results: dict[int, httpx.Response] = {}

        def queued(i: int) -> None:
            results[i] = st.post("/v1/completions", {"prompt": f"queued {i}", "max_tokens": 2})

        waiting = [threading.Thread(target=queued, args=(i,)) for i in range(2)]
        for t in waiting:
            t.start()
        time.sleep(1.0)
        full = st.post("/v1/completions", {"prompt": "one too many", "max_tokens": 2})
        assert full.status_code == 429, full.text
        assert full.json()["error"]["type"] == "RateLimitError" and "max-num-queued-requests" in full.text
        for t in waiting:
            t.join(timeout=30)
        assert [results[i].status_code for i in range(2)] == [504, 504], [results[i].text for i in range(2)]
        assert "queue-timeout" in results[0].json()["error"]["message"]
    finally:
        for s in streams:
            s.close()
    assert st.wait_kv_free() == 0
    assert st.client.completions.create(model=st.model, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_and_frees_kv(st):
    with httpx.stream("POST", st.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 900,
                            "ignore_eos": True, "temperature": 0, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(line for line in lines if line.startswith("data: "))
        assert st.kv_usage() > 0
    # 900 tokens would take far longer than this on CPU: only the abort frees the blocks so soon.
    assert st.wait_kv_free(timeout=5) == 0
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(st.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=3,
                   json={"prompt": "Write a long story.", "max_tokens": 900, "ignore_eos": True})
    assert st.wait_kv_free(timeout=5) == 0


def test_abort_by_the_client_id_ends_every_sequence(st):
    """Abort takes the id the client sent; the scheduler finds the sequences of an n > 1 request (common.client)."""
    req = pb.GenerateRequest(request_id=f"abort-n2-{uuid.uuid4().hex[:6]}", text="Write a long story.",
                             sampling=pb.SamplingParams(n=2, max_tokens=900, ignore_eos=True, temperature=0.8, seed=7))

    async def run() -> tuple[bool, dict[int, str]]:
        found, finish = None, {}
        async with Client(st.sched_addr) as client, client.generate(req) as messages:
            async for msg in messages:
                if found is None:
                    found = await client.abort(req.request_id)
                if msg.finish_reason:
                    finish[msg.index] = msg.finish_reason
        return found, finish

    assert asyncio.run(run()) == (True, {0: "abort", 1: "abort"})
    assert st.wait_kv_free(timeout=5) == 0


# ---- what `vllm bench serve` sends ------------------------------------------------------------------------------

def _sse(r: httpx.Response) -> list[dict | str]:
    out = []
    for line in r.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_vllm_bench_serve_requests(st):
    h = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(st.url + "/v1/models", headers=h).json()  # its first call: the model id
    model = models["data"][0]["id"]
    body = {"model": model, "prompt": "Hello world", "temperature": 0.0, "max_tokens": 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", st.url + "/v1/completions", json=body, headers=h, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert sum(len(e["choices"]) for e in events[:-2]) >= 1
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "temperature": 0.0, "max_completion_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", st.url + "/v1/chat/completions", json=chat, headers=h, timeout=60) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-3]["choices"][0]["finish_reason"] == "length"


# ---- fail-over (last: it restarts the scheduler) ----------------------------------------------------------------

def test_scheduler_kill9_mid_stream_is_invisible(st):
    kw = {"prompt": PROMPTS[2], "temperature": 0.8, "seed": 5, "max_tokens": 48}
    # The request also bans the tokens it would sample after its 8th (logit_bias) and a word (bad_words): if the
    # restarted scheduler lost either, the resumed stream would sample them again and differ.
    plain = st.client.completions.create(model=st.model, extra_body={"ignore_eos": True, "return_token_ids": True},
                                         **kw).choices[0]
    later = set(_token_ids(plain)[8:]) - set(_token_ids(plain)[:8])
    assert later
    extra = {"ignore_eos": True, "logit_bias": {str(t): -100 for t in later}, "bad_words": ["dragon"],
             "return_token_ids": True}
    undisturbed = st.client.completions.create(model=st.model, extra_body=extra, **kw)
    assert _token_ids(undisturbed.choices[0])[:8] == _token_ids(plain)[:8]
    assert not later & set(_token_ids(undisturbed.choices[0])) and "dragon" not in undisturbed.choices[0].text
    chunks = []
    stream = st.client.completions.create(model=st.model, stream=True, extra_body=extra, **kw)
    it = iter(stream)
    for chunk in it:
        chunks.append(chunk.choices[0].text)
        if len(chunks) == 4:
            break
    cluster.kill(st.scheduler)
    down = st.post("/v1/completions", {"prompt": "x", "max_tokens": 1})  # a new request meanwhile: 503
    assert down.status_code == 503 and down.headers["retry-after"]
    # Same port and namespace: the request is still in Redis. Without --queue-timeout: the resumed request waits to be
    # recomputed, and the queue timeout counts from its original arrival.
    st.start_scheduler([a for a in SCHEDULER_ARGS if a not in ("--queue-timeout", "3")])
    for chunk in it:
        chunks.append(chunk.choices[0].text)
    assert "".join(chunks) == undisturbed.choices[0].text
    assert st.wait_kv_free() == 0
