"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser NAME`): a model's free text -> content + calls.

A parser is a function `(text, final) -> Parsed` over the whole text generated so far. With `final` false the text
may stop anywhere: the parser returns only what can no longer change (content that cannot be the start of a call
marker; calls whose name is complete, with their arguments as far as they go), so that a stream can send the growth
since the last call as deltas. Arguments are the model's own JSON text (a raw slice), so the streamed fragments
reassemble to exactly the non-streamed arguments.

Adding a parser: write such a function and add it to PARSERS under the name `--tool-call-parser` takes.
"""

from __future__ import annotations

import ast
import itertools
import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from api_svc import harmony


@dataclass
class Call:
    name: str | None
    arguments: str = ""  # JSON text (a prefix of it while the call is still being generated)
    done: bool = False


@dataclass
class Parsed:
    content: str
    calls: list[Call] = field(default_factory=list)
    reasoning: str = ""  # a reasoning parser's part of the text (vLLM's reasoning_content)


# ---- a scanner for JSON that may stop anywhere -------------------------------------------------------------------

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """`text[i]` is '"': the index after the closing quote, or None when the string is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at `text[i]`, or None when it is not complete yet."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: complete once something follows it
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[Call, int | None]:
    """The call object `{"name": ..., <args key>: {...}}` starting at `text[i]` ('{'), and the index after it (None
    while it is incomplete)."""
    call = Call(name=None)
    args: tuple[int, int | None] | None = None
    j = i + 1
    end = None
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            break
        if text[j] == "}":
            end = j + 1
            break
        if text[j] != '"':
            break  # not JSON: the grammar-free model wrote something else
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        start = skip_ws(text, j + 1)
        stop = value_end(text, start)
        if key == "name" and stop is not None and text[start] == '"':
            call.name = json.loads(text[start:stop])
        elif key in args_keys and start < len(text):
            args = (start, stop)
        if stop is None:
            break
        j = skip_ws(text, stop)
        if j < len(text) and text[j] == ",":
            j += 1
    call.done = end is not None
    if args is not None:
        start, stop = args
        raw = text[start:stop if stop is not None else len(text)]
        if raw.startswith('"'):  # arguments given as a JSON string holding the JSON: sent once complete
            raw = json.loads(raw) if stop is not None else ""
        call.arguments = raw
    elif call.done:
        call.arguments = "{}"
    return call, end


def scan_array(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[list[Call], int | None]:
    """The calls of a JSON array of call objects starting at `text[i]` ('['), and the index after it."""
    calls: list[Call] = []
    j = skip_ws(text, i + 1)
    while j < len(text) and text[j] == "{":
        call, end = scan_call(text, j, args_keys)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    if j < len(text) and text[j] == "]":
        return calls, j + 1
    return calls, None


def _held_back(text: str, marker: str, final: bool) -> str:
    """`text` without an ending that could be the start of `marker` (still arriving)."""
    if final:
        return text
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def whole_calls_or_text(text: str, parsed: Parsed, final: bool) -> Parsed:
    """At the end, text that never named a call is content: the model was not calling. A call whose name came
    through stays a call, also when its object never closed (max_tokens cut it): a stream has sent it already, and
    the whole reply says what the stream said."""
    if not final:
        return parsed
    named = list(itertools.takewhile(lambda c: c.name is not None, parsed.calls))
    return Parsed(parsed.content, named) if named else Parsed(text)


# ---- the parsers -------------------------------------------------------------------------------------------------

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def hermes(text: str, final: bool) -> Parsed:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional
    content."""
    first = text.find(HERMES_START)
    if first < 0:
        return Parsed(_held_back(text, HERMES_START, final))
    out = Parsed(text[:first])
    at = first
    while at >= 0:
        j = skip_ws(text, at + len(HERMES_START))
        if j >= len(text) or text[j] != "{":
            if j < len(text) or final:
                out.calls.append(Call(None))  # a marker without an object: not a call
            break
        call, end = scan_call(text, j, ("arguments", "parameters"))
        out.calls.append(call)
        if end is None:
            break
        at = text.find(HERMES_START, end)
    return whole_calls_or_text(text, out, final)


PYTHON_TAG = "<|python_tag|>"


def llama3_json(text: str, final: bool) -> Parsed:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several separated by `;`, optionally after
    `<|python_tag|>`; text that does not start so is content."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    elif not final and PYTHON_TAG.startswith(body):
        return Parsed("")  # maybe the tag, still arriving
    if not body.startswith("{"):
        return Parsed(text if body or final else "")
    out = Parsed("")
    j = 0
    while j < len(body) and body[j] == "{":
        call, end = scan_call(body, j, ("parameters", "arguments"))
        out.calls.append(call)
        if end is None:
            break
        j = skip_ws(body, end)
        if j < len(body) and body[j] == ";":
            j = skip_ws(body, j + 1)
    return whole_calls_or_text(text, out, final)


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral(text: str, final: bool) -> Parsed:
    """Mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}` objects, or (tokenizer v11+)
    `[TOOL_CALLS]name[ARGS]{...}` once per call."""
    first = text.find(MISTRAL_CALLS)
    if first < 0:
        return Parsed(_held_back(text, MISTRAL_CALLS, final))
    out = Parsed(text[:first])
    rest = text[first + len(MISTRAL_CALLS):]
    j = skip_ws(rest, 0)
    if j < len(rest) and rest[j] == "[":
        calls, _ = scan_array(rest, j, ("arguments", "parameters"))
        out.calls = calls
        return whole_calls_or_text(text, out, final)
    for part in rest.split(MISTRAL_CALLS):
        name, sep, args = part.partition(MISTRAL_ARGS)
        if not sep:
            if final and part.strip():
                out.calls.append(Call(None))
            break
        start = skip_ws(args, 0)
        stop = value_end(args, start)
        out.calls.append(Call(name.strip(), args[start:stop] if stop is not None else args[start:], stop is not None))
    return whole_calls_or_text(text, out, final)


def pythonic(text: str, final: bool) -> Parsed:
    """Python call syntax: `[get_weather(city="Paris"), f(x=1)]` (Llama 3.2/4 style); keyword arguments must be
    literals. A list is sent as a whole once it parses; text that does not start with `[` is content."""
    body = text.strip()
    if not body.startswith("["):
        return Parsed(text)
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return Parsed(text if final else "")
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        return Parsed(text if final or body.endswith("]") else "")
    calls = []
    try:
        for e in tree.elts:
            if not isinstance(e.func, ast.Name) or e.args:
                return Parsed(text)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in e.keywords}
            calls.append(Call(e.func.id, json.dumps(kwargs, ensure_ascii=False), True))
    except (ValueError, TypeError, SyntaxError):
        return Parsed(text)
    return Parsed("", calls)


def openai(text: str, final: bool) -> Parsed:
    """gpt-oss (harmony, api_svc/harmony.py): content from the `final` channel, calls from the messages addressed
    `to=functions.NAME` (their bodies are the arguments' JSON), the `analysis` channel as reasoning. A reply with no
    harmony message at all is content."""
    messages = harmony.read(text, final)
    if messages is None:
        return Parsed(text)
    content = "".join(m.body for m in messages if m.channel in ("final", None) and m.recipient is None)
    reasoning = "".join(m.body for m in messages if m.channel == "analysis" and m.recipient is None)
    calls = [Call(name, m.body, m.done) for m in messages if (name := harmony.function_name(m.recipient))]
    return Parsed(content, calls, reasoning)


@dataclass(frozen=True)
class ToolParser:
    parse: Callable[[str, bool], Parsed]
    keep_special_tokens: bool = False  # its markers are special tokens: keep them in the text
    short_ids: bool = False  # Mistral's templates want 9-character alphanumeric call ids
    reads_reasoning: bool = False  # it also fills Parsed.reasoning (the format marks reasoning itself: harmony)


# The registry: `--tool-call-parser` names.
PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser(hermes, keep_special_tokens=True),
    "llama3_json": ToolParser(llama3_json, keep_special_tokens=True),
    "mistral": ToolParser(mistral, keep_special_tokens=True, short_ids=True),
    "pythonic": ToolParser(pythonic),
    "openai": ToolParser(openai, keep_special_tokens=True, reads_reasoning=True),  # vLLM's name for gpt-oss's
}

_ALNUM = string.ascii_letters + string.digits


def call_id(short: bool = False) -> str:
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"
