"""llmserve.v1 ChatMessages -> what a chat template reads: `messages` as transformers passes them (an assistant's
`tool_calls` with parsed `arguments`, a tool message's `tool_call_id`) and `tools` (OpenAI's JSON array).

The scheduler renders chat prompts, so this is where a gRPC client's and the HTTP API's tool fields meet the
template. Errors are ValueErrors whose message starts with the field path.
"""

from __future__ import annotations

import json

from protos import llmserve_pb2 as pb

MAX_TOOLS_JSON_BYTES = 1 << 20


def template_messages(chat: pb.ChatMessages) -> list[dict]:
    out = []
    for i, m in enumerate(chat.messages):
        msg: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [_tool_call(c, f"chat.messages[{i}].tool_calls[{k}]")
                                 for k, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _tool_call(c: pb.ToolCall, where: str) -> dict:
    # Templates index arguments as a mapping (`tool_call.arguments | items`), as transformers and vLLM hand them.
    try:
        arguments = json.loads(c.arguments) if c.arguments else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}.arguments is not valid JSON: {e}") from None
    fn = {"name": c.name, "arguments": arguments}
    return {"id": c.id, "type": "function", "function": fn}


def template_tools(chat: pb.ChatMessages) -> list[dict] | None:
    if not chat.tools_json:
        return None
    if len(chat.tools_json) > MAX_TOOLS_JSON_BYTES:
        raise ValueError(f"chat.tools_json is {len(chat.tools_json)} bytes long, the limit is {MAX_TOOLS_JSON_BYTES}")
    try:
        tools = json.loads(chat.tools_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"chat.tools_json is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("chat.tools_json must be a JSON array of tool objects")
    return tools
