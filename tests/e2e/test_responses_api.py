"""The Responses API (/v1/responses) with real processes: redis-server, a worker with the bundled model, a scheduler
and two API processes on the scheduler's Redis (stored responses are seen by both), plus one without Redis; driven by
the official `openai` SDK (`client.responses`)."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from llmserve.bench.metrics import metric_sum, scrape
from tests.support import cluster

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the capital of France?"


class Stack:
    def __init__(self, redis_url: str):
        self.worker = cluster.start_worker(["--num-gpu-blocks-override", "256", "--max-model-len", "2048"])
        port, self.metrics_port = cluster.free_port(), cluster.free_port()
        self.scheduler = cluster.start_scheduler(redis_url, self.worker,
                                                 ["--port", port, "--metrics-port", self.metrics_port])
        addr = f"127.0.0.1:{port}"
        cluster.wait_healthy(addr, proc=self.scheduler)
        shared = ["--redis-url", redis_url, "--namespace", self.scheduler.namespace]
        self.a, self.b = cluster.start_api(addr, shared), cluster.start_api(addr, shared)
        self.bare = cluster.start_api(addr)  # no Redis: nothing is stored
        self.ca, self.cb, self.cbare = (self._client(p) for p in (self.a, self.b, self.bare))
        self.model = self.ca.models.list().data[0].id

    @staticmethod
    def _client(api) -> openai.OpenAI:
        url = f"http://127.0.0.1:{api.port}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, api.log_tail()
            time.sleep(0.2)
        return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)

    def kv_usage(self) -> float:
        return metric_sum(scrape(f"http://127.0.0.1:{self.metrics_port}/metrics"), "vllm:kv_cache_usage_perc")

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.a.port}/v1/responses", json={"model": self.model, **body},
                          timeout=120)


@pytest.fixture(scope="module")
def st(redis_server):  # noqa: F811
    stack = Stack(redis_server)
    yield stack
    cluster.stop_all()


def greedy(**kw) -> dict:
    return {"temperature": 0, "max_output_tokens": 12, **kw}


def test_create_whole_and_streamed_agree(st):
    whole = st.ca.responses.create(model=st.model, input=QUESTION, instructions="Answer in one word.", **greedy())
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.output_text
    assert whole.status in ("completed", "incomplete") and whole.instructions == "Answer in one word."
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(st.ca.responses.create(model=st.model, input=QUESTION, instructions="Answer in one word.",
                                         stream=True, **greedy()))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert events[-4].text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_incomplete_at_max_output_tokens(st):
    r = st.ca.responses.create(model=st.model, input="Tell me a long story.", max_output_tokens=3, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stored_response_is_fetched_from_another_api_process(st):
    r = st.ca.responses.create(model=st.model, input=QUESTION, **greedy())
    got = st.cb.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.store is True
    st.cb.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        st.ca.responses.retrieve(r.id)


def test_previous_response_id_continues_the_conversation_from_any_process(st):
    first = st.ca.responses.create(model=st.model, input=QUESTION, **greedy())
    follow = st.cb.responses.create(model=st.model, input="And of Italy?", previous_response_id=first.id, **greedy())
    assert follow.previous_response_id == first.id
    # The same conversation sent in full gives the same prompt and (greedy) the same answer.
    spelled = st.ca.responses.create(model=st.model, store=False, input=[
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And of Italy?"}], **greedy())
    assert follow.usage.input_tokens == spelled.usage.input_tokens > first.usage.input_tokens
    assert follow.output_text == spelled.output_text


def test_function_calls_and_a_tool_loop(st):
    r = st.ca.responses.create(model=st.model, input="What is the weather in Paris?", tools=[WEATHER],
                               tool_choice="required", max_output_tokens=100, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    answer = st.cb.responses.create(model=st.model, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": json.dumps({"celsius": 21})}], **greedy())
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    # previous_response_id carried the call: the same as sending the whole loop as items.
    spelled = st.ca.responses.create(model=st.model, store=False, tools=[WEATHER], tool_choice="none", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"celsius": 21})}],
        **greedy())
    assert answer.usage.input_tokens == spelled.usage.input_tokens > r.usage.input_tokens
    assert answer.output_text == spelled.output_text


def test_streamed_function_call_events(st):
    kw = {"model": st.model, "input": "Weather in Oslo?", "tools": [WEATHER], "temperature": 0,
          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 100}
    whole = st.ca.responses.create(**kw)
    events = list(st.ca.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert events[2].item.name == "get_weather" and events[2].item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == whole.output[0].arguments
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]


def test_text_format_json_schema(st):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    r = st.ca.responses.create(model=st.model, input="A person, as JSON.", temperature=0, max_output_tokens=80,
                               text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_cancel_from_another_process(st):
    r = st.ca.responses.create(model=st.model, input="Tell me a long story.", max_output_tokens=1500,
                               background=True, extra_body={"ignore_eos": True})
    assert r.status == "in_progress"
    assert st.cb.responses.retrieve(r.id).status == "in_progress"
    assert st.cb.responses.cancel(r.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while st.ca.responses.retrieve(r.id).status != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(openai.BadRequestError):  # only what still runs can be cancelled
        st.cb.responses.cancel(st.ca.responses.create(model=st.model, input="Hi", **greedy()).id)
    # The generation was aborted in the scheduler: its KV blocks are free again.
    deadline = time.monotonic() + 30
    while st.kv_usage() > 0:
        assert time.monotonic() < deadline, "the cancelled response still holds KV blocks"
        time.sleep(0.2)


def test_a_stream_left_early_is_stored_cancelled_and_freed(st):
    stream = st.ca.responses.create(model=st.model, input="Tell me a long story.", max_output_tokens=1500,
                                    stream=True, extra_body={"ignore_eos": True})
    events = []
    for e in stream:
        events.append(e)
        if e.type == "response.output_text.delta":
            break
    stream.close()
    rid = events[0].response.id
    deadline = time.monotonic() + 30
    while st.cb.responses.retrieve(rid).status != "cancelled" or st.kv_usage() > 0:
        assert time.monotonic() < deadline, (st.cb.responses.retrieve(rid).status, st.kv_usage())
        time.sleep(0.2)


def test_store_false_and_no_redis(st):
    r = st.ca.responses.create(model=st.model, input="Hi", store=False, **greedy())
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        st.cb.responses.retrieve(r.id)
    bare = st.cbare.responses.create(model=st.model, input="Hi", **greedy())
    assert bare.store is False and bare.output_text
    with pytest.raises(openai.BadRequestError) as e:
        st.cbare.responses.create(model=st.model, input="Hi", previous_response_id="resp_x", **greedy())
    assert "--redis-url" in str(e.value)


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 400, "input"),
    ({"input": 7}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER]}, 400, "tool_choice"),  # auto without --enable-auto-tool-choice
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "hi", "store": False, "background": True}, 400, "background"),
])
def test_bad_fields_name_the_field(st, body, status, param):
    r = st.post(body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
