"""Request bodies of the OpenAI API (vLLM's field names and defaults). Unknown fields are accepted and ignored,
as OpenAI clients send many that this server does not act on.

Ranges that depend on the model or the scheduler (max_model_len, n, top_p, penalties, ...) are checked by the
scheduler, whose messages name the field and the limit; here only what the wire types need (unsigned, int32). The
sampling table's fields (common/sampling_fields.py) are derived from it, typed by llmserve.proto.
"""

from __future__ import annotations

from typing import Annotated, Literal

from google.protobuf.descriptor import FieldDescriptor
from pydantic import BaseModel, ConfigDict, Field, create_model

from api_svc.limits import MAX_N, MAX_STOP_BYTES, MAX_STOP_STRINGS
from api_svc.tools import NamedToolChoice, Tool, ToolCallIn
from common.sampling_fields import FIELDS, LOGIT_BIAS, TOKEN_IDS
from protos import llmserve_pb2 as pb

INT32_MAX = (1 << 31) - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_BYTES)]  # the scheduler counts UTF-8 bytes


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs extra field: one of these."""

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # json: no optional whitespace (the server's config may also say so)


def _wire_type(fd: FieldDescriptor) -> object:
    """The Python type of a llmserve.v1 SamplingParams field, bounded as its wire type is."""
    scalar: object
    if fd.type in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):
        scalar = float
    elif fd.type == fd.TYPE_BOOL:
        scalar = bool
    elif fd.type == fd.TYPE_STRING:
        scalar = str
    else:
        lo, hi = _INT_RANGES[fd.type]
        scalar = Annotated[int, Field(ge=lo, le=hi)]
    return list[scalar] if fd.is_repeated else scalar


_INT_RANGES = {FieldDescriptor.TYPE_INT32: (-(1 << 31), INT32_MAX), FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
               FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1), FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1)}
_PROTO_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name

# The sampling table's fields (common/sampling_fields.py) as the OpenAI body carries them: omitted = None (the
# scheduler's default); typed as llmserve.v1 declares them (token ids: non-negative int32).
_TableFields = create_model(
    "_TableFields", __base__=_Body,
    **{f.public: (Annotated[(list[TokenId] if f.kind == TOKEN_IDS else dict[TokenId, float] if f.kind == LOGIT_BIAS
                             else _wire_type(_PROTO_FIELDS[f.public])), Field(max_length=f.max_items)] | None, None)
       for f in FIELDS if f.public is not None and f.openai})


class SamplingFields(_TableFields):
    """Fields shared by completions and chat completions: the table's, and these."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] = 0
    cache_salt: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool = False  # vLLM's: each choice (and chunk) also carries its output token ids
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = 16  # OpenAI's completions default


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls (api_svc/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    tools: list[Tool] | None = None  # tool calling: api_svc/tools.py
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
