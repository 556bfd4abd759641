"""Tool calling over the OpenAI API with real processes (redis-server, a worker with the bundled model, a scheduler,
two API processes: one plain, one with `--enable-auto-tool-choice --tool-call-parser hermes`), driven by the
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
        self.auto = cluster.start_api(addr, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        self.client = self._client(self.plain)
        self.auto_client = self._client(self.auto)
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


@pytest.mark.parametrize("sampling", SAMPLING)
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


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(st, sampling, parallel):
    r = st.client.chat.completions.create(model=st.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=parallel, max_tokens=300, **sampling)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
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
          "temperature": 0}
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
