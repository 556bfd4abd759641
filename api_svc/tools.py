"""Tool calling in chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

- The tools and the history's `tool_calls` / `tool_call_id` go to the scheduler, which renders them with the model's
  chat template (common/chat_messages.py).
- `required` and a named function are enforced on every model with structured outputs: a JSON schema built from the
  tools' parameter schemas (a named call: its arguments; required: `{"name", "parameters"}` objects, an array of
  them when parallel calls are allowed). No parser is needed.
- `auto` parses the model's free text with `--tool-call-parser` (api_svc/tool_parsers.py), which
  `--enable-auto-tool-choice` must switch on, as in vLLM.
- `none` renders the tools but parses nothing.
- `--reasoning-parser` (api_svc/reasoning_parsers.py) splits every chat reply's reasoning from its content (the
  message's `reasoning_content`); a tool parser then reads the content, or both at once where one format marks both
  (harmony: `--tool-call-parser openai` with `--reasoning-parser openai_gptoss`).

`ToolPlan` is what a request decided; `ChoiceTools` turns one choice's text into content and tool-call deltas.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from api_svc.errors import bad_request
from api_svc.reasoning_parsers import REASONING_PARSERS
from api_svc.tool_parsers import (
    PARSERS,
    Call,
    Parsed,
    ToolParser,
    call_id,
    scan_array,
    scan_call,
    skip_ws,
    whole_calls_or_text,
)
from protos import llmserve_pb2 as pb

CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Open):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Open):
    """A call in an assistant message of the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


def history_fields(chat: pb.ChatMessages, messages: list) -> None:
    """The history's tool fields onto the llmserve.v1 messages (one per request message, in order)."""
    for out, m in zip(chat.messages, messages, strict=True):
        for c in m.tool_calls or ():
            args = c.function.arguments
            out.tool_calls.add(id=c.id, name=c.function.name,
                               arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        if m.tool_call_id:
            out.tool_call_id = m.tool_call_id


def _parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    """The JSON every `required` reply follows: `{"name": <a tool>, "parameters": <its arguments>}`, or a non-empty
    array of them when parallel calls are allowed."""
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": _parameters(t.function)},
                      "required": ["name", "parameters"]} for t in tools]}
    return {"type": "array", "minItems": 1, "items": one} if parallel else one


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its generation and its replies."""

    extract: Callable[[str, bool], Parsed]  # (text so far, final) -> content + calls
    parallel: bool
    short_ids: bool = False
    keep_special_tokens: bool = False
    schema: dict | None = None  # the enforced JSON, for required and named
    reasoning: bool = False  # a reasoning parser runs: Parsed.reasoning is answered as reasoning_content

    def apply(self, req: pb.GenerateRequest) -> None:
        if self.schema is not None:
            req.sampling.json_schema = json.dumps(self.schema)
            # Compact arguments: under a grammar a small model spends max_tokens on newlines and indentation.
            req.sampling.disable_any_whitespace = True
        if self.keep_special_tokens:
            req.sampling.skip_special_tokens = False

    def choice(self) -> ChoiceTools:
        return ChoiceTools(self)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole choice's `message` and its finish_reason ("tool_calls" when it called)."""
        state = self.choice()
        delta = state.feed(text, True)
        reasoning = {"reasoning_content": state.reasoning or None} if self.reasoning else {}
        if not state.ids:  # the content a stream sends: all the text, unless it was held back as a call's
            return {"role": "assistant", "content": state.content, **reasoning}, finish_reason
        calls = [{"id": i, "type": "function", "function": {"name": c["function"]["name"], "arguments": a}}
                 for i, c, a in zip(state.ids, delta["tool_calls"], state.arguments, strict=True)]
        return ({"role": "assistant", "content": delta.get("content") or None, **reasoning, "tool_calls": calls},
                state.finish_reason(finish_reason))


@dataclass
class ChoiceTools:
    """One choice's stream: text pieces in, OpenAI deltas out (content, then each call's first delta with index, id,
    type and name, then its argument fragments)."""

    plan: ToolPlan
    text: str = ""
    content: str = ""  # sent so far
    reasoning: str = ""  # sent so far, as reasoning_content
    ids: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    def feed(self, piece: str, final: bool) -> dict:
        self.text += piece
        parsed = self.plan.extract(self.text, final)
        delta: dict = {}
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            delta["content"] = parsed.content[len(self.content):]
            self.content = parsed.content
        if self.plan.reasoning and len(parsed.reasoning) > len(self.reasoning) \
                and parsed.reasoning.startswith(self.reasoning):
            delta["reasoning_content"] = parsed.reasoning[len(self.reasoning):]
            self.reasoning = parsed.reasoning
        calls: list[Call] = []
        for c in parsed.calls:
            if c.name is None:
                break
            calls.append(c)
        if not self.plan.parallel:
            calls = calls[:1]
        out = []
        for k, c in enumerate(calls):
            if k == len(self.ids):
                self.ids.append(call_id(self.plan.short_ids))
                self.arguments.append(c.arguments)
                out.append({"index": k, "id": self.ids[k], "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}})
            elif len(c.arguments) > len(self.arguments[k]) and c.arguments.startswith(self.arguments[k]):
                out.append({"index": k, "function": {"arguments": c.arguments[len(self.arguments[k]):]}})
                self.arguments[k] = c.arguments
        if out:
            delta["tool_calls"] = out
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.ids and reason == "stop" else reason


def _named(name: str) -> Callable[[str, bool], Parsed]:
    """A named call's text is its arguments (trailing whitespace held back until more follows, so that a stream cut
    by max_tokens sends what the whole reply holds)."""
    def extract(text: str, final: bool) -> Parsed:
        return Parsed("", [Call(name, text.strip(), final)])
    return extract


def _required(parallel: bool) -> Callable[[str, bool], Parsed]:
    def extract(text: str, final: bool) -> Parsed:
        j = skip_ws(text, 0)
        if j >= len(text):
            return Parsed("")
        calls = scan_array(text, j, ("parameters",))[0] if parallel else [scan_call(text, j, ("parameters",))[0]]
        return whole_calls_or_text(text, Parsed("", calls), final)
    return extract


def plan(body, enable_auto_tool_choice: bool, tool_call_parser: str | None,
         reasoning_parser: str | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None: neither tool handling nor a reasoning parser), or a 400 naming the field (or
    the flags, for auto)."""
    tool_plan = _tool_plan(body, enable_auto_tool_choice, tool_call_parser)
    if reasoning_parser is None:
        return tool_plan
    reasoner = REASONING_PARSERS[reasoning_parser]
    if tool_plan is None:
        return ToolPlan(reasoner.parse, True, keep_special_tokens=reasoner.keep_special_tokens, reasoning=True)
    if tool_plan.schema is not None:  # a grammar shapes the reply from its first token: there is no reasoning
        return tool_plan
    keep = tool_plan.keep_special_tokens or reasoner.keep_special_tokens
    if PARSERS[tool_call_parser].reads_reasoning:  # one format marks both (harmony)
        return dataclasses.replace(tool_plan, keep_special_tokens=keep, reasoning=True)
    extract = tool_plan.extract

    def reason_then_call(text: str, final: bool) -> Parsed:
        split = reasoner.parse(text, final)
        parsed = extract(split.content, final)
        return Parsed(parsed.content, parsed.calls, split.reasoning)
    return dataclasses.replace(tool_plan, extract=reason_then_call, keep_special_tokens=keep, reasoning=True)


def _tool_plan(body, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolPlan | None:
    tools: list[Tool] | None = body.tools
    choice = body.tool_choice
    if choice is not None and not tools:
        raise bad_request("tool_choice needs tools: give the tools it may call", "tool_choice")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"tools: the function name {dup!r} appears more than once", "tools")
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if isinstance(choice, str) and choice not in CHOICES:
        raise bad_request(f"tool_choice {choice!r} is unknown; give one of {', '.join(CHOICES)} or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        parser: ToolParser = PARSERS[tool_call_parser]
        return ToolPlan(parser.parse, parallel, parser.short_ids, parser.keep_special_tokens)
    if body.response_format is not None and body.response_format.type != "text" or body.structured_outputs:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains the "
                          "output already: drop response_format / structured_outputs", "tool_choice")
    if choice == "required":
        return ToolPlan(_required(parallel), parallel, schema=required_schema(tools, parallel))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})",
                          "tool_choice")
    return ToolPlan(_named(name), False, schema=_parameters(tools[names.index(name)].function))
