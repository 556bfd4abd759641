"""The streaming detokenizer's Rust path (tokenizers' DecodeStream) against its Python path: the same deltas, push
by push, on random token sequences of the bundled tokenizer (byte tokens that split characters, special tokens,
stop strings, pushes of several tokens) and through a flush that ends mid-character."""

from __future__ import annotations

import random

import pytest

from common.tokenizer import Tokenizer
from scheduler_svc.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from worker_svc.model.loader import default_model_path

    return Tokenizer.from_gguf(default_model_path())


def _run(tok: Tokenizer, prompt: list[int], pushes: list[list[int]], rust: bool, **kw) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt, **kw)
    if not rust:
        det._stream = None
    else:
        assert det._stream is not None
    out = [det.push(p) for p in pushes]
    out.append(det.flush())
    return [*out, det.text, str(det.stopped_by)]


def _sequences(tok: Tokenizer, rng: random.Random):
    text_ids = tok.encode("Hello 👋 世界! 😀🎉 中文测试 café, naïve. <|im_end|> The end 🏽🏽", add_special_tokens=False)
    specials = [tok.eos_token_id, 0, 1, 2]
    for _ in range(60):
        ids = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            ids.append(rng.choice(text_ids) if r < 0.5 else rng.choice(specials) if r < 0.6
                       else rng.randrange(tok.vocab_size))
        cuts, pushes, i = sorted(rng.sample(range(1, len(ids) + 1), min(len(ids), rng.randint(1, 8)))), [], 0
        for c in cuts:
            pushes.append(ids[i:c])
            i = c
        if i < len(ids):
            pushes.append(ids[i:])
        yield [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))], pushes


@pytest.mark.parametrize("kw", [{}, {"skip_special_tokens": False}, {"stop": ["世", "end"]},
                                {"stop": ["ll"], "include_stop_str_in_output": True}])
def test_rust_path_equals_python_path(tok: Tokenizer, kw) -> None:
    rng = random.Random(0)
    for prompt, pushes in _sequences(tok, rng):
        det = IncrementalDetokenizer(tok, prompt, **kw)
        if det._stream is None:
            continue  # a context that ends mid-character is decoded by the Python path only
        assert _run(tok, prompt, pushes, True, **kw) == _run(tok, prompt, pushes, False, **kw), (prompt, pushes)


def test_flush_mid_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans byte tokens
    det = IncrementalDetokenizer(tok, tok.encode("hi"))
    assert det.push(ids[:1]) == ""  # half a character waits
    assert det.flush() == tok.decode(ids[:1])  # ... and the end of the request releases it as U+FFFD
