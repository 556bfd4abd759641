"""The pre-tokenizer a byte-level BPE GGUF names in `tokenizer.ggml.pre`: how text is cut into words before BPE.

A vocabulary's merges were learned on words cut one way (Llama 3 keeps up to three digits together, Qwen2 one,
StarCoder splits every digit off first); cutting another way gives other token ids. The names are
llama.cpp's; each maps to the regex of the model's own tokenizer.json. A name not known here is refused, naming the
field and the value, instead of being read with GPT-2's split.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# Llama 3's split: contractions, letters, numbers of up to three digits, punctuation runs, newlines, spaces.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with every digit a word of its own.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2 = "gpt2"  # ByteLevel's own regex (GPT-2's)
_DIGITS_THEN_GPT2 = "digits+gpt2"  # each digit split off, then GPT-2's regex

_SPLITS: dict[str, str] = {
    # smollm: llama.cpp splits digits first, but transformers' GGUF tokenizer (the reference the served model's
    # outputs are checked against) reads SmolLM GGUFs with GPT-2's split; the two differ on a space run before a digit.
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "smollm"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "codeshell", "exaone"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2),
}

KNOWN_PRE_TOKENIZERS = tuple(sorted(_SPLITS))


def byte_level_pre_tokenizer(pre: str | None, source: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for `tokenizer.ggml.pre` = `pre` (None: a file older than the field, GPT-2's split, as
    llama.cpp reads it)."""
    kind = _SPLITS.get(pre if pre is not None else "default")
    if kind is None:
        raise ValueError(f"{source}: tokenizer.ggml.pre = {pre!r} is not a pre-tokenizer llmserve knows "
                         f"(known: {', '.join(KNOWN_PRE_TOKENIZERS)})")
    if kind == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
