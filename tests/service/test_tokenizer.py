"""Tokenizer (GGUF -> tokenizers) against transformers' GGUF tokenizer, and the streaming detokenizer."""

from __future__ import annotations

import random

import pytest

from common.tokenizer import Tokenizer
from scheduler_svc.core.detokenizer import IncrementalDetokenizer


def _gguf_path() -> str:
    from worker_svc.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(_gguf_path())


@pytest.fixture(scope="module")
def hf_tok(hf_tokenizer):
    return hf_tokenizer  # the session's (tests/conftest.py): transformers' own tokenizer from the same GGUF


TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "The quick brown fox jumps over the lazy dog. It's, they'll, we've!",
    "def f(x):\n\treturn x  *  2\n\n\n    # indented   comment\r\n",
    "numbers: 12345 3.14 -0.001 1e10 2024-06-01 1,000,000",
    "emoji 😀🎉👋🏽 and CJK 中文测试 日本語 한국어, café naïve",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|im_end|><file_sep>",
    "",
    "   \n\n\t\t  ",
]


# ---------------------------------------------------------------- tokenizer
def test_metadata(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == 49152 == len(hf_tok)
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2 == hf_tok.eos_token_id
    assert tok.chat_template == hf_tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok: Tokenizer, hf_tok, text: str) -> None:
    for add_special in (True, False):
        assert tok.encode(text, add_special_tokens=add_special) == hf_tok.encode(
            text, add_special_tokens=add_special
        )


def test_no_bos_added(tok: Tokenizer) -> None:
    # add_bos_token is False in this GGUF
    assert tok.encode("hi")[0] != tok.bos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Hi there 👋"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
    ],
)
def test_chat_template_matches_hf(tok: Tokenizer, hf_tok, messages: list[dict[str, str]]) -> None:
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_chat_template_unknown_role(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"'narrator'.*system, user, assistant, tool"):
        tok.apply_chat_template([{"role": "narrator", "content": "Once upon a time"}])


# ---------------------------------------------------------------- detokenizer
def _stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for i in ids:
        deltas.append(det.push([i]))
        if det.stopped_by is not None:
            break
    return deltas


def test_detok_utf8_one_token_at_a_time(tok: Tokenizer) -> None:
    text = "Hello 👋 世界! 😀🎉 中文测试 café, done."
    ids = tok.encode(text)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "say hi"}]))
    det = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(det, ids)
    deltas.append(det.flush())
    assert "".join(deltas) == tok.decode(ids) == text == det.text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # some tokens ended mid-character and were held back
    assert len(det._ids) < 16  # only a small window is kept and re-decoded


def test_detok_batch_push_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("中文 ok") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert det.push(ids[:3]) + det.push(ids[3:]) + det.flush() == "中文 ok"
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(_stream(det, ids)) + det.flush() == "中文 ok<|im_end|>"


def test_detok_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. END more text")
    det = IncrementalDetokenizer(tok, [], stop=["END"])
    out = "".join(_stream(det, ids))
    assert out == "The answer is 42. " == det.text
    assert det.stopped_by == "END"
    assert det.push(tok.encode(" ignored")) == "" and det.flush() == ""

    det = IncrementalDetokenizer(tok, [], stop=["END"], include_stop_str_in_output=True)
    assert "".join(_stream(det, ids)) == "The answer is 42. END"
    assert det.stopped_by == "END"


def test_detok_stop_string_spans_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. END_OF_ANSWER more")
    stop = "42. END_OF_ANSWER"
    assert not any(stop in tok.decode([i]) for i in ids)
    det = IncrementalDetokenizer(tok, [], stop=["nope", stop])
    deltas = _stream(det, ids)
    assert "".join(deltas) == "The answer is "
    assert det.stopped_by == stop
    # nothing of the stop string leaked before it completed
    assert not any(c in "".join(deltas) for c in "42")


def test_detok_earliest_stop_wins(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["world", "lo w"])
    out = det.push(tok.encode("Hello world!"))
    assert out == "Hel" and det.stopped_by == "lo w"


def test_detok_partial_stop_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    deltas = _stream(det, ids)
    assert "".join(deltas) == "Hello "  # "world" could still become "world peace"
    assert det.stopped_by is None
    assert det.flush() == "world"
    assert det.text == "Hello world" and det.stopped_by is None


def test_detok_partial_stop_released_when_it_diverges(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    assert det.push(tok.encode("Hello world")) == "Hello "
    assert det.push(tok.encode(" war")) == "world war"
    assert det.stopped_by is None


def test_detok_random_chunks_match_reference(tok: Tokenizer) -> None:
    # Any chunking of the token stream gives the same text: decode(all) cut at the earliest stop string.
    rng = random.Random(0)
    text = "Ünïcödé 😀 mixed 中文 text; stop here? ok 👋🏽 done 42 END tail"
    ids = tok.encode(text)
    for stop in ([], ["END"], ["😀 mixed"], ["中文 t"], ["👋🏽"], ["ok 👋", "here?"], ["never"]):
        for _ in range(5):
            det = IncrementalDetokenizer(tok, [], stop=stop)
            out, i = [], 0
            while i < len(ids) and det.stopped_by is None:
                n = rng.randint(1, 4)
                out.append(det.push(ids[i:i + n]))
                i += n
            out.append(det.flush())
            hits = [text.find(s) for s in stop if s in text]
            expected = text[:min(hits)] if hits else text
            assert "".join(out) == expected == det.text, (stop, out)
            assert not any("\ufffd" in d for d in out)


def test_from_hf_dir_round_trip(tok: Tokenizer, hf_tok, tmp_path) -> None:
    hf_tok.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(str(tmp_path))
    assert (loaded.eos_token_id, loaded.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
    assert loaded.chat_template == tok.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
