"""gpt-oss's harmony replies read back: `--tool-call-parser openai` and `--reasoning-parser openai_gptoss` on
recorded token sequences (harmony replies tokenized by a tokenizer holding the harmony special tokens, then streamed
back one token at a time as the detokenizer sends them): content from `final`, reasoning_content from `analysis`,
tool calls from `commentary` messages to functions.NAME; the streamed deltas add up to the whole message."""

from __future__ import annotations

import json

import pytest

from api_svc import harmony
from api_svc.protocol import ChatCompletionRequest
from api_svc.tool_parsers import openai
from api_svc.tools import plan
from tests.support import gpt_oss_checkpoints as gc

REASON_THEN_ANSWER = ("<|channel|>analysis<|message|>The user asks about the weather. I know it.<|end|>"
                      "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
REASON_THEN_CALL = ("<|channel|>analysis<|message|>Need the tool for this.<|end|>"
                    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                    '{"city": "Paris", "unit": "celsius"}<|call|>')
RECIPIENT_IN_ROLE = ("<|channel|>analysis<|message|>Call it.<|end|>"
                     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}'
                     "<|call|>")
CUT_IN_ANSWER = "<|channel|>analysis<|message|>Short.<|end|><|start|>assistant<|channel|>final<|message|>It is su"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("harmony-tokenizer"))
    gc.write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def request(tools: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                 tools=TOOLS if tools else None)


def streamed(tool_plan, pieces: list[str]) -> dict:
    """The deltas of a stream of `pieces` (the last one final), merged as an SDK merges them."""
    state = tool_plan.choice()
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for k, piece in enumerate(pieces):
        delta = state.feed(piece, k == len(pieces) - 1)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    return merged


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` tokenized, then detokenized one token at a time (special tokens kept)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(i >= gc.BYTES for i in ids), "the harmony markers must be special tokens"
    pieces, sent = [], ""
    for n in range(1, len(ids) + 1):
        text_so_far = tokenizer.decode(ids[:n], skip_special_tokens=False)
        pieces.append(text_so_far[len(sent):])
        sent = text_so_far
    assert sent == text
    return pieces


def test_reasoning_and_final_answer(tokenizer):
    p = plan(request(), True, "openai", "openai_gptoss")
    assert p.keep_special_tokens and p.reasoning
    message, finish = p.message(REASON_THEN_ANSWER, "stop")
    assert message == {"role": "assistant", "content": "It is sunny in Paris.",
                       "reasoning_content": "The user asks about the weather. I know it."}
    assert finish == "stop"
    merged = streamed(p, token_pieces(tokenizer, REASON_THEN_ANSWER))
    assert (merged["content"], merged["reasoning_content"]) == (message["content"], message["reasoning_content"])


@pytest.mark.parametrize("text,name,arguments", [
    (REASON_THEN_CALL, "get_weather", '{"city": "Paris", "unit": "celsius"}'),
    (RECIPIENT_IN_ROLE, "get_time", '{"tz": "UTC"}'),
])
def test_tool_call_from_commentary(tokenizer, text, name, arguments):
    p = plan(request(), True, "openai", "openai_gptoss")
    message, finish = p.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] in ("Need the tool for this.", "Call it.")
    [call] = message["tool_calls"]
    assert call["function"] == {"name": name, "arguments": arguments} and call["id"].startswith("call_")
    json.loads(call["function"]["arguments"])
    merged = streamed(p, token_pieces(tokenizer, text))
    assert merged["tool_calls"] == {0: {"name": name, "arguments": arguments}}
    assert merged["reasoning_content"] == message["reasoning_content"] and merged["content"] == ""


def test_every_split_streams_the_whole_message():
    """Cut anywhere (inside a special token too), the deltas add up to the whole reply's fields."""
    p = plan(request(), True, "openai", "openai_gptoss")
    for text in (REASON_THEN_ANSWER, REASON_THEN_CALL):
        whole = openai(text, True)
        for cut in range(1, len(text)):
            merged = streamed(p, [text[:cut], text[cut:]])
            assert merged["content"] == whole.content and merged["reasoning_content"] == whole.reasoning
            assert [c["arguments"] for c in merged["tool_calls"].values()] == [c.arguments for c in whole.calls]


def test_reasoning_parser_without_tools_and_a_cut_answer():
    p = plan(request(tools=False), False, None, "openai_gptoss")
    assert p.reasoning and p.keep_special_tokens
    message, finish = p.message(CUT_IN_ANSWER, "length")
    assert message == {"role": "assistant", "content": "It is su", "reasoning_content": "Short."}
    assert finish == "length"
    # Without the reasoning parser the analysis channel is not content either, and there is no reasoning field.
    message, _ = plan(request(), True, "openai").message(CUT_IN_ANSWER, "length")
    assert message == {"role": "assistant", "content": "It is su"}


def test_a_reply_that_is_not_harmony_is_content():
    p = plan(request(tools=False), False, None, "openai_gptoss")
    assert p.message("just words, no channels", "length")[0] == {
        "role": "assistant", "content": "just words, no channels", "reasoning_content": None}
    assert harmony.read("just words <|chan", False) == []  # a stream holds it back until it knows
    assert harmony.read("<|channel|>final<|message|>Hi <|re", False)[0].body == "Hi "


def test_a_plain_tool_parser_reads_the_content_the_reasoning_parser_leaves():
    p = plan(request(), True, "hermes", "openai_gptoss")
    text = ('<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><|return|>')
    message, finish = p.message(text, "stop")
    assert finish == "tool_calls" and message["reasoning_content"] == "Hmm."
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_headers_read_channel_and_recipient():
    [analysis, call] = harmony.read(REASON_THEN_CALL, True)
    assert (analysis.channel, analysis.recipient, analysis.done) == ("analysis", None, True)
    assert (call.channel, call.recipient) == ("commentary", "functions.get_weather")
    assert harmony.function_name("browser.search") is None  # a built-in tool: not a function call
