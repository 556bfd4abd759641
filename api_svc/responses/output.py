"""A /v1/responses response as it forms: output items (`message` with `output_text`, `function_call`) built from
content and tool-call deltas (api_svc/tools.py's shape), the typed stream events on the way, the response object
and what the store keeps."""

from __future__ import annotations

import json
import secrets
import time

from api_svc import tools
from api_svc.responses.request import NamedFunction, ResponsesRequest


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """A response's output items as they form, from content and tool-call deltas (api_svc/tools.py's shape)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def _close(self) -> list[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        at = {"output_index": len(self.items), "item_id": item["id"]}
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [("response.output_text.done", {**at, "content_index": 0, "text": part["text"], "logprobs": []}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": part}),
                    ("response.output_item.done", {"output_index": at["output_index"], "item": item})]
        return [("response.function_call_arguments.done", {**at, "name": item["name"],
                                                           "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": at["output_index"], "item": item})]

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        """The events of one delta ({"content": ..., "tool_calls": [...]}), in order."""
        events: list[tuple[str, dict]] = []
        index = len(self.items)
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._close()
                index = len(self.items)
                self.open = {"type": "message", "id": _hex_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
                events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.open)}))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.open["content"].append(part)
                events.append(("response.content_part.added", {"output_index": index, "item_id": self.open["id"],
                                                               "content_index": 0, "part": _copy(part)}))
            self.open["content"][0]["text"] += delta["content"]
            events.append(("response.output_text.delta", {"output_index": index, "item_id": self.open["id"],
                                                          "content_index": 0, "delta": delta["content"],
                                                          "logprobs": []}))
        for tc in delta.get("tool_calls", ()):
            fragment = tc["function"].get("arguments", "")
            if "id" in tc:  # a new call
                events += self._close()
                index = len(self.items)
                self.open = {"type": "function_call", "id": _hex_id("fc"), "call_id": tc["id"],
                             "name": tc["function"]["name"], "arguments": "", "status": "in_progress"}
                events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.open)}))
            if fragment and self.open is not None:
                self.open["arguments"] += fragment
                events.append(("response.function_call_arguments.delta", {"output_index": len(self.items),
                                                                          "item_id": self.open["id"],
                                                                          "delta": fragment}))
        return events

    def finish(self) -> list[tuple[str, dict]]:
        return self._close()


def _copy(d: dict) -> dict:
    return json.loads(json.dumps(d))


class Draft:
    """One response being generated: its request, id, conversation and result so far."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, messages: list[dict], plan: tools.ToolPlan | None,
                 stored: bool):
        self.body, self.id, self.model, self.messages, self.plan = body, rid, model, messages, plan
        self.stored = stored
        self.created = int(time.time())
        self.output = Output()
        self.state = plan.choice() if plan is not None else None
        self.finish: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.error: dict | None = None  # a background response that failed

    def feed(self, text: str, finish: str | None, usage) -> list[tuple[str, dict]]:
        final = finish is not None
        if self.state is not None:
            delta = self.state.feed(text, final)
        else:
            delta = {"content": text} if text else {}
        events = self.output.add(delta)
        if final:
            self.finish = finish
            if usage is not None:
                self.usage = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
            events += self.output.finish()
        return events

    @property
    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return {"length": "incomplete", "abort": "cancelled"}.get(self.finish, "completed")

    def response(self, status: str | None = None) -> dict:
        b = self.body
        status = status or self.status
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        tool_choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction) else \
            (b.tool_choice or ("auto" if b.tools else "none"))
        usage = None
        if self.finish is not None:
            usage = {**self.usage, "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"],
                     "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output.items if self.finish is not None else [], "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": b.previous_response_id,
            "temperature": b.temperature, "top_p": b.top_p, "text": {"format": fmt}, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()], "truncation": "disabled",
            "store": self.stored, "background": b.background, "user": b.user, "usage": usage,
        }

    def record(self, status: str | None = None) -> dict:
        """What the store keeps: the response, and the conversation a follow-up continues (its output included)."""
        said = []
        for item in self.output.items:
            if item["type"] == "message":
                said.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if said and "tool_calls" in said[-1]:
                    said[-1]["tool_calls"].append(call)
                else:
                    said.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return {"response": self.response(status), "messages": self.messages + said}


def sse(kind: str, data: dict, seq: int) -> str:
    payload = json.dumps({"type": kind, "sequence_number": seq, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"
