"""A byte-level GGUF's `tokenizer.ggml.pre` picks its word split: token ids equal transformers' GGUF tokenizer's
for the same file, per value; an unknown value is refused naming the field."""

from __future__ import annotations

import json
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


# The first tokens of SmolLM2's vocabulary: its special tokens, the 256 byte symbols and the merges ranked first.
# Building a tokenizer costs time in proportion to the vocabulary (transformers' converter 6 s for all 49,152 here),
# and the word split under test does not depend on the vocabulary's size.
VOCABULARY_SIZE = 3000


@pytest.fixture(scope="module")
def vocabulary(bundled_model_path) -> dict:
    """SmolLM2's first tokens, their types and the merges among them (the bundled GGUF): a complete byte-level BPE
    vocabulary to write small tokenizer-only GGUFs with."""
    reader = gguf.GGUFReader(bundled_model_path)
    full = {key: reader.get_field(f"tokenizer.ggml.{key}").contents() for key in ("tokens", "token_type", "merges")}
    tokens = full["tokens"][:VOCABULARY_SIZE]
    kept = set(tokens)
    merges = [m for m in full["merges"] if m.replace(" ", "") in kept and all(p in kept for p in m.split(" "))]
    assert len(merges) > VOCABULARY_SIZE // 2
    return {"tokens": tokens, "token_type": full["token_type"][:VOCABULARY_SIZE], "merges": merges}


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


# Names transformers' GGUF converter also maps: its tokenizer for the same file is the reference.
@pytest.mark.parametrize("pre", ["tekken", "gpt-4o", "llama4", "qwen35", "falcon-h1", "lfm2", "kormo", "megrez",
                                 "minimax-m2"])
def test_ids_equal_transformers_for_its_other_names(tmp_path, vocabulary, pre):
    test_ids_equal_transformers_per_pre_value(tmp_path, vocabulary, pre)


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_CJK = "[一-龥ࠀ-一가-퟿]+"
# The pre-tokenizer steps of each model's own tokenizer.json (tokenizers' JSON form), for the names transformers'
# converter does not map.
MODEL_PRE_TOKENIZERS = {
    "deepseek-llm": [
        _split("[\r\n]"),
        _split("\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-"
               "\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇ"
               "Ꞌ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"),
        _split("\\s?[!-/:-~！-／：-～‘-‟　-。]+"), _split("\\s+$"), _split(_CJK),
        {"type": "Digits", "individual_digits": False}, _BYTES],
    "deepseek-coder": [_split("[\r\n]"), _split("\\s?\\p{L}+"), _split("\\s?\\p{P}+"), _split(_CJK),
                       {"type": "Digits", "individual_digits": True}, _BYTES],
    "deepseek-v3": [
        _split("\\p{N}{1,3}"), _split("[一-龥぀-ゟ゠-ヿ]+"),
        _split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
               "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
        _BYTES],
    "falcon": [{"type": "Punctuation", "behavior": "Contiguous"},
               {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
               {"type": "Digits", "individual_digits": False}, _split("[0-9][0-9][0-9]")],
}


@pytest.mark.parametrize("pre", sorted(MODEL_PRE_TOKENIZERS))
def test_ids_equal_the_models_own_pre_tokenizer(tmp_path, vocabulary, pre):
    """The same vocabulary and merges with the model's tokenizer.json pre-tokenizer give the same ids."""
    from tokenizers import Tokenizer as HFTokenizer

    ours = Tokenizer.from_gguf(_write(tmp_path, vocabulary, pre))
    spec = json.loads(ours.backend.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": MODEL_PRE_TOKENIZERS[pre]}
    theirs = HFTokenizer.from_str(json.dumps(spec))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False).ids, text


def test_deepseek_splits_cut_where_their_tokenizers_do(tmp_path, vocabulary):
    """DeepSeek Coder: one digit per word; DeepSeek V3: up to three; DeepSeek LLM: a digit run whole."""
    def words(pre: str, text: str) -> list[str]:
        tok = Tokenizer.from_gguf(_write(tmp_path, vocabulary, pre))
        return tok.backend.pre_tokenizer.pre_tokenize_str(text)

    assert [w for w, _ in words("deepseek-coder", "12345")] == list("12345")
    assert [w for w, _ in words("deepseek-v3", "12345")] == ["123", "45"]
    assert [w for w, _ in words("deepseek-llm", "12345")] == ["12345"]
