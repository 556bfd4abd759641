"""A /v1/responses request: its body (OpenAI's Responses fields) and the chat completion it is generated as
(`instructions` + the conversation as chat messages; function tools, tool_choice and text.format as the chat
fields they mirror)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_svc.errors import APIError, bad_request
from api_svc.protocol import INT32_MAX, ChatCompletionRequest, SamplingFields

# Request fields beyond Responses' own that pass to the generation as they are (vLLM's sampling extras).
_NOT_SAMPLING = {"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "response_format",
                 "structured_outputs"}
_SAMPLING_EXTRAS = set(SamplingFields.model_fields) - _NOT_SAMPLING


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentPart(_Open):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(_Open):
    """A message (`role` + `content`), a `function_call` the model made, or a `function_call_output`."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list | dict | None = None


class FunctionTool(_Open):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Open):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """`input` as chat messages: function_call items join into an assistant message's tool_calls,
    function_call_output items become tool messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise bad_request("input is empty: give a string or at least one item", "input")
    out: list[dict] = []
    for k, it in enumerate(body.input):
        if it.type == "message":
            if it.role is None:
                raise bad_request(f"input[{k}].role is missing: user, system, developer or assistant", "input")
            out.append({"role": "system" if it.role == "developer" else it.role, "content": _text(it.content)})
        elif it.type == "function_call":
            if not it.call_id or not it.name:
                raise bad_request(f"input[{k}]: a function_call item needs call_id and name", "input")
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name,
                                                                      "arguments": it.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif it.type == "function_call_output":
            if not it.call_id:
                raise bad_request(f"input[{k}]: a function_call_output item needs call_id", "input")
            output = it.output if isinstance(it.output, str) else json.dumps(it.output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": output})
        # reasoning items carry nothing this server generates: skipped
    return out


def chat_body(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion a response is generated as."""
    chat: dict[str, Any] = {k: v for k, v in (body.model_extra or {}).items() if k in _SAMPLING_EXTRAS}
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat.update(model=body.model, messages=system + messages, max_tokens=body.max_output_tokens,
                temperature=body.temperature, top_p=body.top_p, parallel_tool_calls=body.parallel_tool_calls)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                          "schema": fmt.schema_}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise bad_request(f"input: {where}: {first['msg']}", "input") from None


def renamed(e: APIError) -> APIError:
    """A chat-shaped error in Responses' field names."""
    names = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
    if e.param in names:
        e.param = names[e.param]
        e.message = e.message.replace("max_tokens", "max_output_tokens")
    return e
