"""Structured outputs with real processes: redis-server, a worker with the bundled model (compact JSON:
`--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'`), a scheduler process and
the OpenAI API process.

The worker's KV pool is small on purpose (24 blocks of 16 = 384 tokens), so the concurrent batches below preempt
(checked on the metrics), while a request alone never does: each concurrent output is compared with the same
request run alone. The scheduler kill test comes last: it restarts the scheduler.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest

from llmserve.bench.metrics import metric_sum, scrape
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from tests.support import cluster

MAX_TOKENS = 64
WORKER_ARGS = ["--num-gpu-blocks-override", "24", "--max-model-len", "256",
               "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
SCHEDULER_ARGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--lease-ttl-ms", "2000"]

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "population": {"type": "integer", "minimum": 1,
                                                                 "maximum": 99999999}},
                 "required": ["name", "population"]}}, "required": ["city"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L"]}}, "required": ["color", "size"]},
    "bounded": {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10},
                                                 "passed": {"type": "boolean"}}, "required": ["score", "passed"]},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16},
                                                  "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                                  "rating": {"type": "number"}}, "required": ["title"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["code", "zip"]},
    "list_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "ok": {"type": "boolean"}}, "required": ["id", "ok"]}}},
        "required": ["items"]},
}
# Arithmetic expressions: at most four terms, parentheses nest one level.
ARITHMETIC = ('root ::= expr\n'
              'expr ::= term (" " [-+*] " " term){0,3}\n'
              'term ::= num | "(" num (" " [-+*] " " num){1,2} ")"\n'
              'num ::= [1-9] [0-9]{0,2}')
ARITHMETIC_RE = re.compile(r"^(\d+|\(\d+( [-+*] \d+){1,2}\))( [-+*] (\d+|\(\d+( [-+*] \d+){1,2}\)))*$")


def prompt(name: str) -> str:
    return f"Reply with a JSON value for a {name.replace('_', ' ')}."


class Stack:
    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.worker = cluster.start_worker(WORKER_ARGS)
        self.sched_port, self.metrics_port = cluster.free_port(), cluster.free_port()
        self.namespace = cluster.new_namespace("structured")
        self.start_scheduler()
        self.api = cluster.start_api(self.address)
        self.url = f"http://127.0.0.1:{self.api.port}"
        deadline = time.monotonic() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, self.api.log_tail()
            time.sleep(0.2)
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)
        self.model = self.openai.models.list().data[0].id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sched_port}"

    def start_scheduler(self) -> None:
        self.scheduler = cluster.start_scheduler(
            self.redis_url, self.worker, [*SCHEDULER_ARGS, "--port", self.sched_port,
                                          "--metrics-port", self.metrics_port], namespace=self.namespace)
        cluster.wait_healthy(self.address, proc=self.scheduler)

    def metric(self, name: str) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"), name)

    def generate(self, req: pb.GenerateRequest) -> list[tuple[list[int], str, str]]:
        """(token ids, text, finish reason) of each of the request's sequences."""
        n = max(1, req.sampling.n)
        ids, text, finish = [[] for _ in range(n)], [""] * n, [""] * n
        with grpc.insecure_channel(self.address) as ch:
            for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300):
                ids[m.index] += m.token_ids
                text[m.index] += m.text
                finish[m.index] = m.finish_reason or finish[m.index]
        return list(zip(ids, text, finish, strict=True))

    def wait_kv_free(self, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while (usage := self.metric("vllm:kv_cache_usage_perc")) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return usage


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    s = Stack(redis_server)
    yield s
    cluster.stop_all()


def chat(text: str, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 0.0)
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]),
                              sampling=pb.SamplingParams(**sampling))


def schema_request(name: str, sampled: bool, **extra) -> pb.GenerateRequest:
    kw = {"temperature": 0.8, "seed": 1234} if sampled else {}
    return chat(prompt(name), json_schema=json.dumps(SCHEMAS[name]), **kw, **extra)


def run_all(st: Stack, reqs: dict[str, pb.GenerateRequest]) -> dict[str, list[tuple[list[int], str, str]]]:
    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = {k: pool.submit(st.generate, r) for k, r in reqs.items()}
        return {k: f.result() for k, f in futures.items()}


def assert_valid(name: str, text: str, finish: str) -> None:
    assert finish == "stop", f"{name}: the grammar did not complete within {MAX_TOKENS} tokens: {text!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"{name}: {e}: {text!r}") from None
    jsonschema.validate(value, SCHEMAS[name])


# ---- JSON schemas: gRPC and the OpenAI SDK, greedy and sampled, under preemption ------------------------------


def test_json_schemas_validate_greedy_and_sampled_through_grpc_and_the_openai_sdk(st):
    # References, each request alone (no preemption): two greedy, one sampled, one n=2 sampled.
    alone = {("person", False): st.generate(schema_request("person", False)),
             ("tags", False): st.generate(schema_request("tags", False)),
             ("enum", True): st.generate(schema_request("enum", True)),
             ("n2", True): st.generate(schema_request("nested", True, n=2))}
    preempted = st.metric("vllm:num_preemptions_total")
    hits = st.metric("vllm:prefix_cache_hits_total")
    reqs = {(name, sampled): schema_request(name, sampled) for name in SCHEMAS for sampled in (False, True)}
    reqs["n2", True] = schema_request("nested", True, n=2)
    out = run_all(st, reqs)
    for (name, _), seqs in out.items():
        for _, text, finish in seqs:
            assert_valid("nested" if name == "n2" else name, text, finish)
    # 17 requests of ~60 tokens in a 384-token pool: they preempted each other, and the repeated prompts hit the
    # prefix cache; the outputs are those of the requests run alone all the same.
    assert st.metric("vllm:num_preemptions_total") > preempted
    assert st.metric("vllm:prefix_cache_hits_total") > hits
    for key, ref in alone.items():
        assert out[key] == ref, key
    assert out["n2", True][0] != out["n2", True][1]  # n=2: two samples (seed, seed + 1), both valid

    # The OpenAI SDK: response_format json_schema (chat, greedy: the same text as gRPC) and vLLM's
    # structured_outputs (completions, seeded sampling).
    def sdk_chat(name: str):
        return st.openai.chat.completions.create(
            model=st.model, messages=[{"role": "user", "content": prompt(name)}], temperature=0, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})

    def sdk_completion(name: str):
        return st.openai.completions.create(
            model=st.model, prompt=prompt(name) + "\n", temperature=0.8, seed=7, max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"json": SCHEMAS[name]}})

    with ThreadPoolExecutor(16) as pool:
        chats = {name: pool.submit(sdk_chat, name) for name in SCHEMAS}
        completions = {name: pool.submit(sdk_completion, name) for name in SCHEMAS}
        for name in SCHEMAS:
            c = chats[name].result().choices[0]
            assert_valid(name, c.message.content, c.finish_reason)
            assert c.message.content == out[name, False][0][1], name
            c = completions[name].result().choices[0]
            assert_valid(name, c.text, c.finish_reason)
    assert st.wait_kv_free() == 0


# ---- regex, choice, EBNF, json_object; mixed with unconstrained requests ---------------------------------------


def test_regex_choice_grammar_json_object_beside_unconstrained_requests(st):
    plain = {f"plain{i}": chat(p, max_tokens=24, ignore_eos=True)
             for i, p in enumerate(["The capital of France is", "def fibonacci(n):", "Once upon a time"])}
    alone = {k: st.generate(r) for k, r in plain.items()}
    constrained = {
        "date": chat("When did the first moon landing happen?", regex=r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"),
        "email": chat("Write an email address for John.", regex=r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"),
        "fixed": chat("Give a flight number.", regex=r"[A-Z]{2}[0-9]{3,4}"),
        "choice": chat("Is the sky blue? Answer.", choice=pb.ChoiceConstraint(choices=["yes", "no", "not sure"])),
        "choice_sampled": chat("Pick a fruit.", temperature=1.0, seed=3,
                               choice=pb.ChoiceConstraint(choices=["apple", "banana", "cherry"])),
        "arith": chat("Write an arithmetic expression.", grammar=ARITHMETIC),
        "arith_sampled": chat("Write an arithmetic expression.", grammar=ARITHMETIC, temperature=0.9, seed=11),
        "object": chat('Reply with this JSON object: {"animal": "cat", "legs": 4}', json_object=True),
    }
    masked = st.metric("llmserve:structured_output_masked_tokens_total")
    out = run_all(st, {**plain, **constrained})
    for k in plain:  # unconstrained neighbours change nothing
        assert out[k] == alone[k], k
    text = {k: out[k][0][1] for k in constrained}
    unfinished = {k: out[k][0][1:] for k in constrained if out[k][0][2] != "stop"}
    assert not unfinished, unfinished
    assert re.fullmatch(r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d", text["date"])
    assert re.fullmatch(r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)", text["email"])
    assert re.fullmatch(r"[A-Z]{2}[0-9]{3,4}", text["fixed"])
    assert text["choice"] in ("yes", "no", "not sure")
    assert text["choice_sampled"] in ("apple", "banana", "cherry")
    for k in ("arith", "arith_sampled"):
        assert ARITHMETIC_RE.fullmatch(text[k]), text[k]
        eval(compile(text[k], "<expr>", "eval"), {"__builtins__": {}})  # parses (and evaluates) as Python
    assert isinstance(json.loads(text["object"]), dict)
    assert st.metric("llmserve:structured_output_masked_tokens_total") > masked

    # vLLM's engine protocol (what smg sends): its constraint oneof maps onto the same path.
    choices = ["yes", "no", "not sure"]
    ref = st.generate(pb.GenerateRequest(text="Is the sky blue? Answer:", sampling=pb.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, choice=pb.ChoiceConstraint(choices=choices))))[0]
    assert ref[2] == "stop" and ref[1] in choices
    with grpc.insecure_channel(st.address) as ch:
        complete = [m.complete for m in vpb_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
            request_id="vllm-choice", text="Is the sky blue? Answer:", sampling_params=vpb.SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, choice=vpb.ChoiceConstraint(choices=choices))), timeout=120)
            if m.HasField("complete")]
    assert list(complete[0].output_ids) == ref[0] and complete[0].finish_reason == "stop"


# ---- refusals ----------------------------------------------------------------------------------------------------


BAD = [
    ({"json_schema": '{"type": "objectx"}'}, "sampling.json_schema", "objectx"),
    ({"json_schema": "{not json"}, "sampling.json_schema", "not valid JSON"),
    ({"json_schema": '"a string"'}, "sampling.json_schema", "must be a JSON object"),
    ({"json_schema": '{"$ref": "#/definitions/missing"}'}, "sampling.json_schema", "missing"),
    ({"regex": "(ab"}, "sampling.regex", "parenthesis"),
    ({"regex": ""}, "sampling.regex", "empty"),
    ({"choice": pb.ChoiceConstraint()}, "sampling.choice", "empty"),
    ({"grammar": "root ::= undefined_rule"}, "sampling.grammar", "undefined_rule"),
]


def test_bad_constraints_are_refused_naming_the_field_and_nothing_else_is_affected(st):
    for fields, field, reason in BAD:
        with pytest.raises(grpc.RpcError) as e:
            st.generate(chat("Hi", **fields))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, e.value.details())
        assert field in e.value.details() and reason in e.value.details(), (fields, e.value.details())
    # vLLM's protocol: its own field names; structural_tag stays refused.
    with grpc.insecure_channel(st.address) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        for sp, field in ((vpb.SamplingParams(regex="[a-"), "sampling_params.regex"),
                          (vpb.SamplingParams(structural_tag="{}"), "sampling_params.structural_tag")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(vpb.GenerateRequest(request_id="bad", text="Hi", sampling_params=sp), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
    # HTTP 400 with OpenAI's error body.
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": {"type": "nope"}}}},
                         "json_schema"),
                        ({"structured_outputs": {"regex": "(("}}, "regex"),
                        ({"structured_outputs": {"choice": []}}, "choice"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                         "structured_outputs")):
        r = httpx.post(st.url + "/v1/chat/completions", timeout=60, json={
            "model": st.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    # The engine is fine: a constrained and a plain request still run, no KV block is left behind.
    assert st.generate(chat("Is the sky blue?", choice=pb.ChoiceConstraint(choices=["yes", "no"])))[0][2] == "stop"
    assert st.generate(chat("Hi", max_tokens=4))[0][2] == "length"
    assert st.wait_kv_free() == 0


# ---- a slow compile does not stall the others --------------------------------------------------------------------


def slow_schema(tag: str) -> dict:
    """Compiles for the time of many decode steps: many fields with patterns (a fresh tag: never cached)."""
    props = {f"{tag}_{i}": {"type": "string", "pattern": "^[a-z]{3,8}@[a-z]{2,6}\\.(com|org|net)$"} for i in range(240)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_slow_compile_does_not_delay_other_streams(st):
    stamps: dict[str, list[float]] = {}

    def stream(key: str, req: pb.GenerateRequest) -> None:
        stamps[key] = []
        with grpc.insecure_channel(st.address) as ch:
            for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300):
                stamps[key] += [time.monotonic()] * len(m.token_ids)

    others = [threading.Thread(target=stream, args=(f"o{i}", chat(p, max_tokens=160, ignore_eos=True)))
              for i, p in enumerate(["Count to a hundred:", "List animals:"])]
    for t in others:
        t.start()
    while min((len(stamps.get(f"o{i}", [])) for i in range(2)), default=0) < 5:
        time.sleep(0.05)
    compiled_before = st.metric("llmserve:structured_output_compile_seconds_sum")
    t0 = time.monotonic()
    slow = threading.Thread(target=stream, args=("slow", chat("Fill in the form.", max_tokens=4,
                                                              json_schema=json.dumps(slow_schema(f"s{t0:.0f}")))))
    slow.start()
    slow.join(300)
    first_slow = stamps["slow"][0]
    compile_s = st.metric("llmserve:structured_output_compile_seconds_sum") - compiled_before
    for t in others:
        t.join(300)
    # While the slow grammar compiled (the request waited for it before it was queued), the others kept streaming:
    # counted in tokens, not seconds. A compile on the step loop would hold every stream for the whole compile, so
    # at most the step already in flight would land in the window; off the loop, each stream gets a token per step.
    during = {k: sum(t0 <= t < first_slow for t in stamps[k]) for k in ("o0", "o1")}
    print(f"slow compile {compile_s:.2f}s; tokens the others received meanwhile: {during}")
    assert compile_s > 0, "no grammar was compiled for the slow request"
    assert min(during.values()) >= 3, during


# ---- scheduler kill -9 mid-output (last: it replaces the scheduler) ----------------------------------------------


def reattaching_stream(st: Stack, req: pb.GenerateRequest, out: dict) -> None:
    """Follow `req` to its end across scheduler restarts: on UNAVAILABLE re-attach from the tokens received."""
    ids: list[int] = []
    text, finish, sessions = "", "", 0
    deadline = time.monotonic() + 300
    while not finish and time.monotonic() < deadline:
        req.resume_from_token = len(ids)
        try:
            with grpc.insecure_channel(st.address) as ch:
                sessions += 1
                for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300):
                    ids += m.token_ids
                    text += m.text
                    finish = m.finish_reason or finish
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(0.2)
    out[req.request_id] = (ids, text, finish, sessions)


def test_scheduler_kill_mid_output_resumes_the_same_valid_output(st):
    reqs = {"list_of_objects": schema_request("list_of_objects", False), "optional": schema_request("optional", True)}
    reference = {name: st.generate(r)[0] for name, r in reqs.items()}
    for name, r in reqs.items():
        r.request_id = f"kill-{name}-{time.monotonic_ns()}"
    ledger = cluster.ledger(st.redis_url, st.namespace)
    out: dict = {}
    threads = [threading.Thread(target=reattaching_stream, args=(st, r, out)) for r in reqs.values()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while True:  # mid-output: a few tokens committed, not finished
        got = [ledger.get_request(r.request_id) for r in reqs.values()]
        if all(g is not None and len(g.output_ids) >= 3 for g in got):
            break
        assert time.monotonic() < deadline, "no progress before the kill"
        time.sleep(0.02)
    cluster.kill(st.scheduler)
    assert not any(g.finished for g in got), "a request finished before the kill: not mid-output"
    # The new scheduler (same port: the clients re-attach) resumes the requests on the worker, which replays each
    # one's output into a fresh matcher.
    st.start_scheduler()
    for t in threads:
        t.join(300)
    for name, r in reqs.items():
        ids, text, finish, sessions = out[r.request_id]
        assert sessions >= 2, f"{name}: never re-attached"
        assert (ids, text, finish) == reference[name], name
        assert_valid(name, text, finish)
