"""gpt-oss's reply in the harmony format, read back into channels: `final` (the answer), `analysis` (reasoning) and
`commentary` messages addressed `to=functions.NAME` (tool calls).

The prompt ends with `<|start|>assistant` (the chat template's generation prompt), so the reply begins inside the
first message's header. A message is `{header}<|message|>{body}` ended by `<|end|>` (another message follows, from
`<|start|>`), `<|return|>` (the answer is done) or `<|call|>` (a tool call waits for its result); the header holds
`<|channel|>NAME`, optionally `to=RECIPIENT` (also before the channel, after the role) and `<|constrain|>TYPE`.
Written from the format's published description (OpenAI's harmony guide); the `openai-harmony` package loads its
vocabulary over the network at run time, which a server here cannot count on.

`read(text, final)` takes the whole reply so far (special tokens kept in the text); with `final` false the text may
stop anywhere, and what it returns only grows as more text comes: a body's ending that could be the start of a
special token is held back, and a header counts once its `<|message|>` has come.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
_ENDINGS = (END, RETURN, CALL)
_MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *_ENDINGS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class Message:
    channel: str | None
    recipient: str | None  # "functions.get_weather" for a tool call; None for a message to the user
    body: str
    done: bool  # its ending token came


def _held_back(body: str) -> str:
    """`body` without an ending that could be the start of a special token still arriving."""
    cut = body.rfind("<")
    if cut >= 0 and any(m.startswith(body[cut:]) for m in _MARKERS):
        return body[:cut]
    return body


def _header(text: str) -> tuple[str | None, str | None]:
    channel = _CHANNEL.search(text)
    recipient = _RECIPIENT.search(text)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def read(text: str, final: bool) -> list[Message] | None:
    """The reply's messages so far; None when the reply is not harmony (it ended without any `<|message|>`)."""
    messages: list[Message] = []
    at = 0
    while at < len(text):
        opened = text.find(MESSAGE, at)
        if opened < 0:
            break  # a header still arriving (or, at the end, trailing text that opens no message)
        channel, recipient = _header(text[at:opened])
        start = opened + len(MESSAGE)
        ends = [(i, m) for m in _ENDINGS if (i := text.find(m, start)) >= 0]
        if not ends:
            body = text[start:]
            messages.append(Message(channel, recipient, body if final else _held_back(body), False))
            break
        stop, marker = min(ends)
        messages.append(Message(channel, recipient, text[start:stop], True))
        at = stop + len(marker)
        if text.startswith(START, at):
            at += len(START)
    if final and not messages:
        return None
    return messages


def function_name(recipient: str | None) -> str | None:
    """The called function of a `to=functions.NAME` recipient (None for anything else: the user, built-in tools)."""
    if recipient is None or not recipient.startswith("functions."):
        return None
    return recipient[len("functions."):]
