"""A SentencePiece GGUF (`tokenizer.ggml.model` = llama): token ids equal the model's own tokenizer.json (Llama 2's
form: "▁" for every space plus one before the text, BPE over the pieces by score, byte fallback to `<0xXX>`), with
BOS as the file says; any other tokenizer model is refused naming the field."""

from __future__ import annotations

import os

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from common.tokenizer import Tokenizer

TEXTS = [
    "numbers: 1 12 123 1234 12345 3.14159 -0.001 1e10 2024-06-01 1,000,000",
    "It's, they'll, we've, I'M, you'D, she's!",
    "emoji 😀🎉👋🏽 and CJK 中文测试 日本語 한국어, café naïve",
    "def f(x):\n\treturn x  *  2\n\n\n    # indented   comment\r\n",
    "   \n\n\t\t  trailing   ",
    "Hello world, the quick brown fox jumps over the lazy dog.",
]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello there", "it's what they'll say we've done",
    "def main(args):\n    return args * 2\n", "numbers 123 456 7890 and 3.14", "a tokenizer cuts text into pieces",
] * 20
_SPECIALS = ["<unk>", "<s>", "</s>"]
_UNKNOWN, _CONTROL, _BYTE, _NORMAL = 2, 3, 6, 1  # gguf.TokenType


@pytest.fixture(scope="module")
def pieces() -> list[tuple[str, float, int]]:
    """(piece, score, token type) of a small SentencePiece-style BPE vocabulary: the specials, the 256 byte
    pieces, then pieces learned on a corpus, each scored by when it was learned (earlier: higher)."""
    trainer_tok = HFTokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer_tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
    out = [(t, 0.0, _UNKNOWN if t == "<unk>" else _CONTROL) for t in _SPECIALS]
    out += [(f"<0x{b:02X}>", 0.0, _BYTE) for b in range(256)]
    out += [(t, -float(i), _NORMAL) for i, (t, _) in enumerate(learned)]
    return out


def _write(tmp_path, pieces, name: str, model: str = "llama", add_space_prefix: bool | None = None) -> str:
    path = os.path.join(tmp_path, name)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_token_list([p for p, _, _ in pieces])
    w.add_token_scores([s for _, s, _ in pieces])
    w.add_token_types([t for _, _, t in pieces])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(pieces, add_space_prefix: bool) -> HFTokenizer:
    """The model's tokenizer.json, Llama 2's shape: merges are every pair whose joined piece is in the vocabulary,
    the highest-scored joined piece first (SentencePiece's BPE)."""
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    score = {p: s for p, s, _ in pieces}
    pairs = [(p[:k], p[k:]) for p, _, ty in pieces if ty == _NORMAL for k in range(1, len(p))
             if p[:k] in vocab and p[k:] in vocab]
    pairs.sort(key=lambda lr: (-score[lr[0] + lr[1]], vocab[lr[0]], vocab[lr[1]]))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_ids_equal_the_models_sentencepiece_tokenizer(tmp_path, pieces, add_space_prefix):
    ours = Tokenizer.from_gguf(_write(tmp_path, pieces, "spm.gguf", add_space_prefix=add_space_prefix))
    theirs = _reference(pieces, add_space_prefix is not False)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.encode(text) == [1, *ids]  # BOS, as llama.cpp adds to a SentencePiece vocabulary by default
        assert ours.decode(ids) == text


def test_unknown_characters_fall_back_to_their_bytes(tmp_path, pieces):
    ours = Tokenizer.from_gguf(_write(tmp_path, pieces, "spm.gguf"))
    ids = ours.encode("中", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == ["▁", "<0xE4>", "<0xB8>", "<0xAD>"]


def test_other_tokenizer_models_refused(tmp_path, pieces):
    path = _write(tmp_path, pieces, "t5.gguf", model="t5")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model = 't5'"):
        Tokenizer.from_gguf(path)
