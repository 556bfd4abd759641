"""One sequence's way out of the public API: committed tokens -> text deltas (stop strings included), logprobs,
the final message with its usage."""

from __future__ import annotations

from common.tokenizer import Tokenizer
from protos import llmserve_pb2 as pb
from scheduler_svc.core.detokenizer import IncrementalDetokenizer
from scheduler_svc.core.request import FINISH_STOP
from scheduler_svc.driver.outbox import Published


class SequenceStream:
    """One sequence's way out: committed tokens -> text deltas, stop strings, the final message."""

    def __init__(self, tokenizer: Tokenizer, pub: Published, index: int, resume_from: int):
        req = pub.request
        self.pub = pub
        self.tokenizer = tokenizer
        self.index = index
        self.resume_from = resume_from
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, req.skip_special_tokens, req.stop,
                                            req.include_stop_str_in_output)
        self.sent = 0  # tokens consumed from pub.token_ids
        self.stopped_by_string = False

    def has_news(self) -> bool:  # called under the driver lock
        if self.sent == 0 and self.resume_from == 0 and self.pub.awaits_prompt_logprobs:
            return False  # the first message carries them: a recovered request's tokens wait for its recompute
        return len(self.pub.token_ids) > self.sent or self.pub.finish_reason is not None

    def take(self):  # called under the driver lock
        return self.pub.token_ids[self.sent :], self.pub.logprobs[self.sent :], self.pub.finish_reason

    def advance(self, rid: str, new: list[int], lps: list, finish: str | None):
        """Turn new tokens into one message; returns it and the finish reason (None while running)."""
        msg = pb.GenerateResponse(request_id=rid, index=self.index, first_token_index=max(self.sent, self.resume_from))
        if self.sent == 0 and self.resume_from == 0 and self.pub.prompt_logprobs is not None:
            add_prompt_logprobs(msg, self.pub.request.prompt_ids, self.pub.prompt_logprobs)
        # vLLM's rule: the token that stopped the request (EOS, a stop token id) is not part of the text, also
        # when special tokens are kept (tool parsers keep them to see their markers).
        silent = len(new) - 1 if finish == FINISH_STOP and new and self._is_stop_token(new[-1]) else None
        for i, tok in enumerate(new):
            delta = "" if i == silent else self.detok.push([tok])
            index = self.sent + i
            if index >= self.resume_from:
                msg.token_ids.append(tok)
                msg.text += delta
                lp = lps[i] if i < len(lps) else None
                if lp is not None:
                    msg.logprobs.add(token_id=tok, logprob=lp.logprob,
                                     top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
            if self.detok.stopped_by is not None:
                self.sent = index + 1
                self.stopped_by_string = True
                finish = FINISH_STOP
                break
        else:
            self.sent += len(new)
        if finish is not None:
            if not self.stopped_by_string:
                msg.text += self.detok.flush()
            msg.finish_reason = finish
            msg.usage.prompt_tokens = self.pub.request.num_prompt_tokens
            msg.usage.completion_tokens = self.sent
        return msg, finish

    def _is_stop_token(self, tok: int) -> bool:
        """Whether the request's last token ended it as a stop token whose text stays out: a stop token id, or a
        special token (EOS) that shows only because special tokens are kept; include_stop_str_in_output keeps it."""
        req = self.pub.request
        if req.include_stop_str_in_output:
            return False
        if tok in (req.sampling.stop_token_ids or ()):
            return True
        return not self.tokenizer.decode([tok], skip_special_tokens=True) and \
            bool(self.tokenizer.decode([tok], skip_special_tokens=False))


def add_prompt_logprobs(msg: pb.GenerateResponse, prompt_ids: list[int], lps: list) -> None:
    """The prompt's token ids and, from its second token on, each one's logprob and top ones."""
    msg.prompt_token_ids.extend(prompt_ids)
    for tok, lp in zip(prompt_ids[1:], lps[1:], strict=True):
        msg.prompt_logprobs.add(token_id=tok, logprob=lp.logprob,
                                top=[pb.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
