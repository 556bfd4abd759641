"""Tool calling over the OpenAI API with real processes (redis-server, a worker with the bundled model, a scheduler,
API processes: one plain, one with `--enable-auto-tool-choice --tool-call-parser NAME` per parser), driven by the
official `openai` SDK.

The bundled model was not trained for tools; `required` and named calls are enforced by structured outputs, so
their arguments must validate against the tools' schemas all the same.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from api_svc.tool_parsers import PARSERS
from tests.support import cluster

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 32},
                                                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "max_results"], "additionalProperties": False}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Put an event in the calendar",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "all_day": {"type": "boolean"}},
        "required": ["title", "attendees", "all_day"], "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "toggle_lights", "description": "Lights on or off",
                                         "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                                        "required": ["on"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD, SEARCH, EVENT, FLAG]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SAMPLING = [pytest.param({"temperature": 0}, id="greedy"), pytest.param({"temperature": 1.0, "seed": 7}, id="seeded")]


class Stack:
    def __init__(self, redis_url: str):
        self.worker = cluster.start_worker(["--num-gpu-blocks-override", "256", "--max-model-len", "2048"])
        self.sched_port = cluster.free_port()
        self.scheduler = cluster.start_scheduler(redis_url, self.worker, ["--port", self.sched_port])
        cluster.wait_healthy(f"127.0.0.1:{self.sched_port}", proc=self.scheduler)
        addr = f"127.0.0.1:{self.sched_port}"
        self.plain = cluster.start_api(addr)
        self.autos = {name: cluster.start_api(addr, ["--enable-auto-tool-choice", "--tool-call-parser", name])
                      for name in PARSERS}
        self.client = self._client(self.plain)
        self.parser_clients = {name: self._client(api) for name, api in self.autos.items()}
        self.auto_client = self.parser_clients["hermes"]
        self.model = self.client.models.list().data[0].id

    @staticmethod
    def _client(api) -> openai.OpenAI:
        url = f"http://127.0.0.1:{api.port}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, api.log_tail()
            time.sleep(0.2)
        return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.plain.port}/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    stack = Stack(redis_server)
    yield stack
    cluster.stop_all()


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# Seeded named calls are slow: seeded sampling under the tool-call constraint is test_required_calls_validate's.
@pytest.mark.parametrize("sampling", [SAMPLING[0], pytest.param(*SAMPLING[1].values, marks=pytest.mark.slow,
                                                                id=SAMPLING[1].id)])
def test_named_calls_validate_against_each_schema(st, sampling):
    for tool in TOOLS:
        name = tool["function"]["name"]
        r = st.client.chat.completions.create(model=st.model, messages=ASK, tools=TOOLS, tool_choice=named(name),
                                              max_tokens=200, **sampling)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


# The default run keeps one case per value of each (parallel greedy, one seeded call); the other two are slow.
@pytest.mark.parametrize("parallel,sampling", [
    pytest.param(True, {"temperature": 0}, id="True-greedy"),
    pytest.param(False, {"temperature": 1.0, "seed": 7}, id="False-seeded"),
    pytest.param(False, {"temperature": 0}, id="False-greedy", marks=pytest.mark.slow),
    pytest.param(True, {"temperature": 1.0, "seed": 7}, id="True-seeded", marks=pytest.mark.slow)])
def test_required_calls_validate(st, sampling, parallel):
    r = st.client.chat.completions.create(model=st.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=parallel, max_tokens=300, **sampling)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    if choice.finish_reason == "length":  # the bundled model may go on calling (an array has no end) until cut off
        assert parallel and len(calls) > 1, choice
        calls = calls[:-1]  # the last one as far as it got
    else:
        assert choice.finish_reason == "tool_calls", choice
    for call in calls:
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(chunks) -> tuple[list[dict], str | None, str]:
    """Streamed tool-call deltas -> calls, as a client library joins them; also the finish reason and content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.index not in calls:  # the first delta of a call: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return [calls[k] for k in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", ["required", named("create_event")], ids=["required", "named"])
def test_streamed_deltas_reassemble_to_the_whole_call(st, choice):
    kw = {"model": st.model, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160,
          "temperature": 0, "parallel_tool_calls": False}  # one call: the bundled model may go on calling
    whole = st.client.chat.completions.create(**kw).choices[0]
    chunks = list(st.client.chat.completions.create(stream=True, **kw))
    calls, finish, content = reassemble(chunks)
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    fragments = sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert fragments > len(calls)  # the arguments arrive in pieces, not in one delta


def test_two_turn_tool_loop(st):
    """call -> the tool's result -> an answer that reads it (the history renders with the tool messages)."""
    messages = list(ASK)
    first = st.client.chat.completions.create(model=st.model, messages=messages, tools=TOOLS,
                                              tool_choice=named("get_weather"), max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    second = st.client.chat.completions.create(model=st.model, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=24, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    # The tool's answer reached the prompt: the history with it is longer than without it.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_parses_hermes_calls_and_passes_plain_text(st):
    r = st.auto_client.chat.completions.create(model=st.model, messages=ASK, tools=TOOLS, max_tokens=12,
                                               temperature=0)
    # The bundled model answers in prose: no call, its text is the content (finish_reason as generated).
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_a_hermes_call_out_of_generated_text(st):
    """A model that writes Hermes' format (forced here with a regex constraint, as the bundled model does not): the
    parser turns the real generated text into a call, whole and streamed."""
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in said)
    kw = {"model": st.model, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0,
          "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = st.auto_client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    calls, finish, content = reassemble(list(st.auto_client.chat.completions.create(stream=True, **kw)))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_auto_without_the_flags_is_400(st):
    for kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            st.client.chat.completions.create(model=st.model, messages=ASK, tools=TOOLS, max_tokens=4, **kw)
        assert "--enable-auto-tool-choice" in str(e.value) and "--tool-call-parser" in str(e.value)


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": named("nope")}, "tool_choice", "nope"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": 7}, "tool_choice", ""),
    ({"tools": [{"type": "retrieval"}]}, "tools", ""),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "more than once"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"parallel_tool_calls": "yes please"}, "parallel_tool_calls", ""),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages", ""),
])
def test_bad_tool_fields_are_400_naming_the_field(st, body, param, words):
    r = st.post({"model": st.model, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_history_arguments_must_be_json(st):
    messages = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    r = st.post({"model": st.model, "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "arguments is not valid JSON" in r.json()["error"]["message"]


def test_served_name_is_the_model_file_name(st):
    from worker_svc.model.loader import default_model_path

    assert st.model == default_model_path().rsplit("/", 1)[1]


def escaped(text: str) -> str:
    """A literal text as a regex (a constraint that makes the model say exactly it, then stop on EOS)."""
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)


def streamed(client: openai.OpenAI, **kw) -> tuple[list[dict], str | None, str]:
    return reassemble(list(client.chat.completions.create(stream=True, **kw)))


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_answers_without_a_call_carry_no_stop_token_text(st, parser):
    """The parsers keep special tokens to see their markers; the EOS that ended the answer is still not part of it
    (vLLM's rule), whole or streamed. A regex makes the answer end on EOS for certain; the free answer too."""
    client = st.parser_clients[parser]
    said = "The capital of France is Paris."
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    for extra in ({"extra_body": {"structured_outputs": {"regex": escaped(said)}}}, {}):
        kw = {"model": st.model, "messages": ask, "tools": TOOLS, "max_tokens": 48, "temperature": 0, **extra}
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.message.tool_calls is None and "<|" not in whole.message.content, whole
        if extra:
            assert whole.message.content == said and whole.finish_reason == "stop"
        calls, finish, content = streamed(client, **kw)
        assert calls == [] and content == whole.message.content and finish == whole.finish_reason


def test_forced_arguments_are_compact_json(st):
    """`required` and named calls are generated without optional whitespace, so a two-field call fits 64 tokens
    (with free whitespace the model spent them on newlines and indentation)."""
    for choice in ("required", named("get_weather")):
        r = st.client.chat.completions.create(model=st.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                              parallel_tool_calls=False, max_tokens=64, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        args = choice.message.tool_calls[0].function.arguments
        assert args == json.dumps(json.loads(args), ensure_ascii=False), args  # no whitespace but ", " and ": "
        jsonschema.validate(json.loads(args), SCHEMAS["get_weather"])


def test_json_schema_whitespace_follows_the_request(st):
    """vLLM's per-request structured_outputs.disable_any_whitespace: compact JSON on a server whose config leaves
    whitespace free."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    r = st.client.chat.completions.create(
        model=st.model, messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=96,
        temperature=0, extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert text == json.dumps(json.loads(text), ensure_ascii=False), text
    jsonschema.validate(json.loads(text), schema)


CUT_CALLS = [pytest.param("required", id="required"), pytest.param(named("create_event"), id="named"),
             pytest.param("hermes", id="auto-hermes")]


# The uncut greedy `required` and named calls, streamed against whole, are the very requests of
# test_streamed_deltas_reassemble_to_the_whole_call: slow here. The cut ones and the uncut Hermes call stay.
@pytest.mark.parametrize("choice,max_tokens", [
    *(pytest.param(c.values[0], n, id=f"{c.id}-{n}") for c in CUT_CALLS for n in (6, 13)),
    pytest.param("hermes", 160, id="auto-hermes-160"),
    *(pytest.param(c.values[0], 160, id=f"{c.id}-160", marks=pytest.mark.slow) for c in CUT_CALLS[:2])])
def test_streamed_and_whole_calls_agree_in_every_finish_state(st, choice, max_tokens):
    """The same greedy request whole and streamed: the same finish reason, content and calls, with the streamed
    `arguments` joining to the whole one's, also where max_tokens cuts the call (finish_reason length)."""
    kw = {"model": st.model, "messages": ASK, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0}
    client = st.client
    if choice == "hermes":  # a model writing Hermes' format (the bundled one does not by itself)
        said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        client, kw["extra_body"] = st.auto_client, {"structured_outputs": {"regex": escaped(said)}}
    else:  # one call: in an array the bundled model may go on calling until max_tokens
        kw["tool_choice"], kw["parallel_tool_calls"] = choice, False
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == ("tool_calls" if max_tokens == 160 else "length"), whole
    calls, finish, content = streamed(client, **kw)
    assert finish == whole.finish_reason and content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
