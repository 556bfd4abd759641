"""The tool-call parsers (api_svc/tool_parsers.py) and the stream of deltas built on them (api_svc/tools.py), on
outputs as tool-calling models write them: whole, and streamed a few characters at a time, where the deltas must
reassemble to the whole parse."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from api_svc.tool_parsers import PARSERS, Call, Parsed, hermes, llama3_json, mistral, pythonic, value_end
from api_svc.tools import NamedToolChoice, Tool, ToolPlan, plan, required_schema

# Outputs in each model family's own format (Hermes 2 Pro / Qwen2.5, Llama 3.1, Mistral 7B v0.3, Mistral v11
# tokenizer, Llama 3.2 pythonic, gpt-oss harmony), each with the calls it holds and its content.
RECORDED = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}\n</tool_call>',
         "I will look both up.\n", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "Europe/Oslo"})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}', "",
         [("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 4, '
         '"b": 5}}', "", [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]),
        ("Hello! How can I help you today?", "Hello! How can I help you today?", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
         '"celsius"}}]', "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
        ('Sure.[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2]}}]', "Sure.",
         [("a", {}), ("b", {"x": [1, 2]})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "",
         [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
        ("Bonjour !", "Bonjour !", []),
    ],
    "pythonic": [
        ('[get_weather(city="San Francisco", metric="celsius"), get_time(tz="PST")]', "",
         [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("get_time", {"tz": "PST"})]),
        ("[search(query='llm serving', limit=3, exact=False, tags=['a', 'b'])]", "",
         [("search", {"query": "llm serving", "limit": 3, "exact": False, "tags": ["a", "b"]})]),
        ("I cannot call a tool for that.", "I cannot call a tool for that.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
    "openai": [  # gpt-oss's harmony channels (more in test_harmony_parser.py)
        ('<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "",
         [("get_weather", {"city": "Paris"})]),
        ("<|channel|>final<|message|>Hello there.<|return|>", "Hello there.", []),
    ],
}
CASES = [pytest.param(name, *case, id=f"{name}-{k}") for name, cases in RECORDED.items()
         for k, case in enumerate(cases)]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parser_on_recorded_outputs(parser, text, content, calls):
    parsed = PARSERS[parser].parse(text, True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.done for c in parsed.calls)


def stream(plan: ToolPlan, text: str, step: int) -> list[dict]:
    state = plan.choice()
    deltas = [state.feed(text[i:i + step], False) for i in range(0, len(text), step)]
    return [d for d in [*deltas, state.feed("", True)] if d]


def join(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            if tc["index"] not in calls:
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["name"]
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("parser,text,content,calls", [c for c in CASES if c.values[3]])
def test_streamed_deltas_reassemble_to_the_whole_parse(parser, text, content, calls, step):
    p = PARSERS[parser]
    plan = ToolPlan(p.parse, parallel=True, short_ids=p.short_ids)
    message, finish = plan.message(text, "stop")
    assert finish == "tool_calls" and (message["content"] or "") == content
    got_content, got_calls = join(stream(plan, text, step))
    assert got_content == content
    assert got_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_a_call_cut_off_stays_a_call_and_unnamed_text_is_content():
    cut = hermes('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', True)
    assert cut.content == "" and cut.calls == [Call("get_weather", '{"city": "Pa', False)]
    text = '<tool_call>\n{"name": "get_wea'
    assert hermes(text, True) == Parsed(text)  # no name came through: not a call
    message, finish = ToolPlan(hermes, True).message(text, "length")
    assert message == {"role": "assistant", "content": text} and finish == "length"


def prefixes(text: str) -> list[str]:
    return [text[:k] for k in range(len(text) + 1)]


def forced(choice, parallel: bool = True) -> ToolPlan:
    """The plan of a request forcing calls of the tools f and g."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in ("f", "g")]
    body = SimpleNamespace(tools=tools, tool_choice=choice, parallel_tool_calls=parallel, response_format=None,
                           structured_outputs=None)
    return plan(body, False, None)


def forced_plans() -> list[tuple[ToolPlan, str]]:
    """required (one call, parallel) and named, with compact text as their grammars write it."""
    one = '{"name": "f", "parameters": {"city": "Paris", "unit": "celsius"}}'
    g = NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}})
    return [(forced("required", False), one),
            (forced("required"), f'[{one}, {{"name": "g", "parameters": {{"x": [1, 2]}}}}]'),
            (forced(g), '{"x": [1, 2], "y": "a b"} ')]


@pytest.mark.parametrize("step", [1, 4])
def test_streamed_and_whole_agree_wherever_max_tokens_cuts(step):
    """Every prefix of every output, as a reply cut by max_tokens: the deltas reassemble to the whole reply (the
    same content, the same calls with the same arguments), for each parser and for forced calls."""
    cases = [(ToolPlan(PARSERS[name].parse, True, PARSERS[name].short_ids), text)
             for name, recorded in RECORDED.items() for text, _, calls in recorded if calls]
    for tool_plan, text in cases + forced_plans():
        for cut in prefixes(text):
            message, finish = tool_plan.message(cut, "length")
            assert finish == "length"
            whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
            assert join(stream(tool_plan, cut, step)) == ((message["content"] or ""), whole), (cut, message)


def test_content_is_streamed_before_the_call_and_markers_are_held_back():
    deltas = stream(ToolPlan(hermes, True), 'Let me see. <tool_call>{"name": "f", "arguments": {}}</tool_call>', 2)
    text = "".join(d.get("content", "") for d in deltas)
    assert text == "Let me see. " and "<" not in text
    assert hermes("Sure <tool_", False).content == "Sure "  # may be the marker: not sent yet
    assert hermes("Sure <tool_", True).content == "Sure <tool_"


def test_mistral_ids_are_nine_alphanumerics():
    message, _ = ToolPlan(mistral, True, short_ids=True).message('[TOOL_CALLS][{"name": "f", "arguments": {}}]',
                                                                "stop")
    call_id = message["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()


def test_parallel_false_keeps_the_first_call_and_length_stays_length():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    message, finish = ToolPlan(llama3_json, False).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"] and finish == "tool_calls"
    _, finish = ToolPlan(llama3_json, True).message(text, "length")
    assert finish == "length"


def test_partial_arguments_grow_and_strings_wait():
    assert llama3_json('{"name": "f", "parameters": {"x": [1, 2', False).calls == [Call("f", '{"x": [1, 2', False)]
    assert llama3_json('{"name": "f", "arguments": "{\\"x\\": 1', False).calls == [Call("f", "", False)]
    assert llama3_json('{"name": "f", "arguments": "{\\"x\\": 1}"}', True).calls == [Call("f", '{"x": 1}', True)]
    assert pythonic('[f(x="a', False).calls == [] and pythonic('[f(x="a', False).content == ""


def test_value_end():
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('"a\\"b" x', 0) == 6
    assert value_end("123", 0) is None and value_end("123,", 0) == 3
    assert value_end('[1, {"a": [2]}', 0) is None


def test_required_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    parsed = [Tool.model_validate(t) for t in tools]
    one = required_schema(parsed, parallel=False)
    assert [a["properties"]["name"] for a in one["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert one["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    many = required_schema(parsed, parallel=True)
    assert many["type"] == "array" and many["minItems"] == 1 and many["items"] == one


def test_every_registered_parser_has_a_recorded_case():
    assert set(PARSERS) == set(RECORDED)
