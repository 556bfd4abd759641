"""Tools and tool history reach a chat template (common/chat_messages.py), rendered as the scheduler renders them,
with a tool-aware template in the style of Qwen2.5's (tools as JSON, calls as <tool_call> JSON, tool results)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from common.chat_messages import template_messages, template_tools
from common.tokenizer import Tokenizer
from protos import llmserve_pb2 as pb

TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}} id={{ c.id }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def tokenizer() -> Tokenizer:
    return Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), bos_token_id=None, eos_token_id=None,
                     chat_template=TEMPLATE)


def chat() -> pb.ChatMessages:
    c = pb.ChatMessages(tools_json=json.dumps([WEATHER]))
    c.messages.add(role="user", content="Weather in Paris?")
    m = c.messages.add(role="assistant", content="")
    m.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    c.messages.add(role="tool", content='{"celsius": 21}', tool_call_id="call_1")
    return c


def test_tools_calls_and_results_render():
    c = chat()
    text = tokenizer().apply_chat_template(template_messages(c), tools=template_tools(c))
    assert text == (
        '<tools>{"name": "get_weather", "parameters": {"type": "object"}}</tools>\n'
        "<|user|>Weather in Paris?"  # (the newline after a block tag is trimmed, as in transformers)
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} id=call_1</tool_call>'
        '<|tool|>{"celsius": 21} (for call_1)'
        "<|assistant|>")


def test_without_tools_nothing_changes():
    c = pb.ChatMessages()
    c.messages.add(role="user", content="hi")
    assert template_tools(c) is None
    assert template_messages(c) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("tools_json,words", [("[{", "chat.tools_json is not valid JSON"),
                                              ('{"a": 1}', "JSON array of tool objects")])
def test_bad_tools_json_names_the_field(tools_json, words):
    with pytest.raises(ValueError, match=words):
        template_tools(pb.ChatMessages(tools_json=tools_json))


def test_bad_arguments_name_the_call():
    c = chat()
    c.messages[1].tool_calls[0].arguments = "{nope"
    with pytest.raises(ValueError, match=r"chat\.messages\[1\]\.tool_calls\[0\]\.arguments is not valid JSON"):
        template_messages(c)
