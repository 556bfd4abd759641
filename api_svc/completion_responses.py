"""OpenAI response objects (vLLM's shapes): completions and chat completions, whole or as stream chunks, their
logprobs and usage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

from api_svc.bridge import Delta
from api_svc.prompt_logprobs import PromptScores, echo_logprobs, joined, vllm_prompt_logprobs
from api_svc.tools import ChoiceTools, ToolPlan
from common.tokenizer import Tokenizer
from protos import llmserve_pb2 as pb


class TokenStrings:
    """Token id -> its text, for logprobs (`token_id:N` when no tokenizer is loaded, as vLLM's
    --return-tokens-as-token-ids spells them)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class Reply:
    """What a response needs besides the outputs: its id, the model name, the sequences per prompt."""

    id: str
    model: str
    n: int
    strings: TokenStrings
    chat: bool
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt number -> its length
    completion_tokens: int = 0
    tools: ToolPlan | None = None  # chat: tool calls enforced or parsed (api_svc/tools.py)
    tool_streams: dict[int, ChoiceTools] = field(default_factory=dict)  # choice index -> its state
    echo_logprobs: bool = False  # completions with echo and logprobs: the prompt's tokens lead the logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given: each choice carries them

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def count(self, prompt: int, delta: Delta) -> None:
        if delta.usage is not None:
            self.prompt_tokens[prompt] = delta.usage.prompt_tokens
            self.completion_tokens += delta.usage.completion_tokens

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    # ---- logprobs
    def completion_logprobs(self, ids: list[int], lps: list[pb.TokenLogprobs], offset: int) -> dict:
        """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset (from `offset` chars on)."""
        tokens, offsets = [], []
        for t in ids:
            offsets.append(offset)
            tokens.append(self.strings.text(t))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.strings.text(x.token_id): x.logprob for x in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[pb.TokenLogprobs]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.strings.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(x.token_id, x.logprob)
                                                                               for x in lp.top]} for lp in lps]}

    # ---- stream chunks
    def chunk(self, index: int, delta: Delta | None, *, text: str | None = None, first: bool = False,
              want_logprobs: bool = False, text_offset: int = 0) -> dict | None:
        """A stream chunk; None when it would carry nothing (tool-call text still being parsed)."""
        body = delta.text if text is None else text
        finish = delta.finish_reason if delta is not None else None
        lps = delta.logprobs if delta is not None and want_logprobs else []
        if self.chat:
            moved = {"role": "assistant", "content": body} if first else {"content": body}
            if self.tools is not None and not first:
                state = self.tool_streams.setdefault(index, self.tools.choice())
                moved, finish = state.feed(body, finish is not None), state.finish_reason(finish)
                if not moved and finish is None and not lps:
                    return None
            choice = {"index": index, "delta": moved,
                      "logprobs": self.chat_logprobs(lps) if lps else None, "finish_reason": finish}
        else:
            logprobs = self.completion_logprobs(delta.token_ids, lps, text_offset) if lps else None
            choice = {"index": index, "text": body, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids if delta is not None else []
        if self.prompt_logprobs and delta is not None and delta.prompt:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.strings.text, delta.prompt)
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def echo_chunk(self, index: int, text: str, prompt: PromptScores | None) -> dict:
        """A streamed completion's echoed prompt, with its tokens' logprobs when they were asked."""
        chunk = self.chunk(index, None, text=text)
        if prompt:
            chunk["choices"][0]["logprobs"] = echo_logprobs(self.strings.text, prompt)
        return chunk

    def usage_chunk(self) -> dict:
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage()}


@dataclass
class ChoiceText:
    """One choice of a whole (non-streamed) response, accumulated from its deltas."""

    prefix: str = ""  # echo: the prompt
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt: PromptScores | None = None

    def add(self, delta: Delta) -> None:
        self.prompt = delta.prompt or self.prompt
        self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


def whole(reply: Reply, choices: list[ChoiceText], want_logprobs: bool) -> dict:
    out = []
    for i, c in enumerate(choices):
        prompt = c.prompt or choices[i - i % reply.n].prompt  # n > 1: the first sequence scored the prompt
        if reply.chat:
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if reply.tools is not None:
                message, finish = reply.tools.message(c.text, finish)
            out.append({"index": i, "message": message,
                        "logprobs": reply.chat_logprobs(c.logprobs) if want_logprobs else None,
                        "finish_reason": finish})
        else:
            logprobs = reply.completion_logprobs(c.token_ids, c.logprobs, len(c.prefix)) if want_logprobs else None
            if reply.echo_logprobs and prompt:
                logprobs = joined(echo_logprobs(reply.strings.text, prompt), logprobs)
            out.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                        "stop_reason": None})
        if reply.return_token_ids:
            out[-1]["token_ids"] = c.token_ids
        if reply.prompt_logprobs and not reply.chat:
            out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(reply.strings.text, prompt) if prompt else None
    body = {**reply.head(reply.object), "choices": out, "usage": reply.usage()}
    if reply.prompt_logprobs and reply.chat:  # vLLM: chat's are the response's, not a choice's
        body["prompt_logprobs"] = vllm_prompt_logprobs(reply.strings.text, choices[0].prompt) \
            if choices[0].prompt else None
    return body
