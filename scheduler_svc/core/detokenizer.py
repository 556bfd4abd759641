"""Streaming token ids -> text deltas, with stop strings.

Two things make streaming text harder than `decode(all_ids)`:
- a token can end in the middle of a multi-byte UTF-8 character (emoji, CJK under byte-level BPE), which
  decodes to U+FFFD until the next token completes it;
- a stop string can span several tokens, so text that might be its beginning must not be sent yet.

Incremental decoding uses the prefix/read offset technique: only a short window of recent tokens is
decoded each push, and the new text is the part of window's text past the already-emitted prefix. The tokenizers
library's `DecodeStream` runs that same technique in Rust (about a third of the per-token cost of doing it here) and
serves every push; the Python version stays for what `DecodeStream` does not do: the text of an unfinished
character at the end of a request, and a window whose text does not extend its prefix (the library refuses it).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from common.tokenizer import Tokenizer

# Tokens of prompt context decoded along with the first output tokens, so that decoders that depend on
# the previous token (e.g. SentencePiece's leading-space handling) render the first output token right.
_PROMPT_CONTEXT = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]  # an empty stop string would match everywhere
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None

        # ids[prefix_offset:read_offset] were decoded into text already handed out (a context window);
        # ids[read_offset:] are tokens whose text is not out yet (incomplete UTF-8).
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = self._decode(self._ids)  # None: not computed since the stream emitted
        # The Rust stream holds the same window (its prefix ids[prefix_offset:read_offset]); ids are still kept
        # here so that the Python path can take over at flush or after a refusal.
        self._stream: DecodeStream | None = None
        if not self._prefix_text.endswith(_REPLACEMENT_CHAR):  # else the library would emit the context's text
            self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)

        self._held = ""  # decoded text held back because it could be the start of a stop string
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._chunks: list[str] = []  # everything emitted, joined lazily by `text`

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text that may be sent to the client now."""
        if self.stopped_by is not None or not token_ids:
            return ""
        self._ids.extend(token_ids)
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tokenizer.backend, list(token_ids))
            except Exception:  # noqa: BLE001  (a window that does not extend its prefix: sliced below instead)
                self._stream = None
            else:
                if delta is None:
                    return self._emit("", final=False)
                # Slide the window as _decode_new does: the tokens just emitted become the prefix.
                del self._ids[:self._read_offset]
                self._read_offset = len(self._ids)
                self._prefix_text = None
                return self._emit(delta, final=False)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of request (EOS, length, abort): release whatever was held back."""
        if self.stopped_by is not None:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    # ---------------------------------------------------------------- internals
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset, or "" while it still ends in half a character."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        # Cost is the window since the last emission, not the whole output.
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. skipped special tokens: nothing visible yet
        if window_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # a multi-byte character is cut; wait for the token that completes it
        delta = window_text[len(self._prefix_text):]
        # Slide the window: the tokens just emitted become the context for the next ones.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])
        # Drop ids we will never decode again, so memory (and slicing) stays bounded by the window.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta

    def _emit(self, delta: str, final: bool) -> str:
        """Apply stop strings to held + delta, record and return the part that can go out."""
        if not self.stop:
            out = delta
        else:
            # Any stop string ending in `delta` starts inside `held + delta`: held is the longest tail of
            # the text that is a proper prefix of some stop string, so nothing earlier can be part of one.
            buf = self._held + delta
            hit = self._find_stop(buf)
            if hit is not None:
                pos, stop = hit
                self.stopped_by = stop
                self._held = ""
                out = buf[:pos + len(stop)] if self.include_stop_str_in_output else buf[:pos]
            else:
                keep = 0 if final else self._partial_stop_len(buf)
                out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self._chunks.append(out)
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """The earliest stop string occurrence in buf (first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = buf.find(s)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
