"""A byte-level GGUF's `tokenizer.ggml.pre` picks its word split: token ids equal transformers' GGUF tokenizer's
for the same file, per value; an unknown value is refused naming the field."""

from __future__ import annotations

import os

import gguf
import pytest

from common.tokenizer import Tokenizer

TEXTS = [
    "numbers: 1 12 123 1234 12345 3.14159 -0.001 1e10 2024-06-01 1,000,000",
    "It's, they'll, we've, I'M, you'D, she's!",
    "emoji 😀🎉👋🏽 and CJK 中文测试 日本語 한국어, café naïve",
    "def f(x):\n\treturn x  *  2\n\n\n    # indented   comment\r\n",
    "   \n\n\t\t  trailing   ",
    "<|im_start|>user\nhi 42<|im_end|>\n",
]


@pytest.fixture(scope="module")
def vocabulary(bundled_model_path) -> dict:
    """SmolLM2's tokens, types and merges (the bundled GGUF), to write small tokenizer-only GGUFs with."""
    reader = gguf.GGUFReader(bundled_model_path)
    return {key: reader.get_field(f"tokenizer.ggml.{key}").contents() for key in ("tokens", "token_type", "merges")}


def _write(tmp_path, vocabulary: dict, pre: str) -> str:
    path = os.path.join(tmp_path, f"tok-{pre}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocabulary["tokens"])
    w.add_token_types(vocabulary["token_type"])
    w.add_token_merges(vocabulary["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_ids_equal_transformers_per_pre_value(tmp_path, vocabulary, pre):
    from transformers import AutoTokenizer

    path = _write(tmp_path, vocabulary, pre)
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


def test_splits_differ_where_the_models_do(tmp_path, vocabulary):
    """The same vocabulary cut three ways: Llama 3 keeps 3 digits together, Qwen2 and StarCoder one."""
    toks = {pre: Tokenizer.from_gguf(_write(tmp_path, vocabulary, pre)) for pre in ("llama-bpe", "qwen2", "starcoder")}
    words = {pre: [t.decode([i]) for i in t.encode("x 12345", add_special_tokens=False)] for pre, t in toks.items()}
    assert "".join(words["llama-bpe"]) == "x 12345"
    assert all(len(w.strip()) <= 1 for w in words["qwen2"][1:])  # one digit per token
    assert words["starcoder"] == words["qwen2"]


def test_unknown_pre_value_refused(tmp_path, vocabulary):
    path = _write(tmp_path, vocabulary, "no-such-split")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre = 'no-such-split'"):
        Tokenizer.from_gguf(path)
