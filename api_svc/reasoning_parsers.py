"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's flag): a model's free text -> content + reasoning, answered
as the message's `reasoning_content` (vLLM's field) beside its `content`.

A parser is a function `(text, final) -> Parsed` over the whole text so far, with the tool parsers' contract
(api_svc/tool_parsers.py): with `final` false it returns only what can no longer change. A chat request's tool plan
(api_svc/tools.py) runs it on every chat reply, and any `--tool-call-parser` on the content it leaves.
"""

from __future__ import annotations

from api_svc.tool_parsers import Parsed, ToolParser, openai


def openai_gptoss(text: str, final: bool) -> Parsed:
    """gpt-oss (harmony): the `analysis` channel is the reasoning, the `final` channel the content; tool calls are
    the `openai` tool parser's (without it, a reply's calls are not content either)."""
    parsed = openai(text, final)
    return Parsed(parsed.content, [], parsed.reasoning)


# The registry: `--reasoning-parser` names (a ToolParser's fields: the markers are special tokens, kept in the text).
REASONING_PARSERS: dict[str, ToolParser] = {
    "openai_gptoss": ToolParser(openai_gptoss, keep_special_tokens=True, reads_reasoning=True),
}
