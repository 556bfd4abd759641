"""Prompt logprobs in OpenAI's and vLLM's response shapes.

The scheduler sends them once, in a request's first message (`prompt_token_ids`, and `prompt_logprobs` for every
prompt token from the second on). Completions with `echo` and `logprobs` put them in front of the output's
(OpenAI's completions format: tokens, token_logprobs with null first, top_logprobs, text_offset); vLLM's
`prompt_logprobs` request field returns them as vLLM does: a list with null first, then per token a map token id ->
{logprob, rank, decoded_token} of the token itself and its top ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import llmserve_pb2 as pb


@dataclass
class PromptScores:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # from the second token on

    def __bool__(self) -> bool:
        return bool(self.token_ids)


def echo_logprobs(text, scores: PromptScores) -> dict:
    """OpenAI's completions logprobs of the prompt tokens (`text(token id)`: the token's string); text_offset from
    0, so that the output's entries continue after the echoed prompt."""
    tokens = [text(t) for t in scores.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [None] + [lp.logprob for lp in scores.logprobs],
            "top_logprobs": [None] + [{text(x.token_id): x.logprob for x in lp.top} for lp in scores.logprobs],
            "text_offset": offsets}


def joined(first: dict, then: dict | None) -> dict:
    """Two completions logprobs objects, one after the other."""
    if then is None:
        return first
    return {k: first[k] + then[k] for k in first}


def vllm_prompt_logprobs(text, scores: PromptScores) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then {token id: {logprob, rank, decoded_token}} of the
    token and its top ones (rank: 1 for the most likely; null for the token itself when it is not among them)."""
    out: list[dict | None] = [None]
    for lp in scores.logprobs:
        entry = {str(x.token_id): {"logprob": x.logprob, "rank": r, "decoded_token": text(x.token_id)}
                 for r, x in enumerate(lp.top, 1)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None, "decoded_token": text(lp.token_id)})
        out.append(entry)
    return out
