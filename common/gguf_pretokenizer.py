"""The pre-tokenizer a byte-level BPE GGUF names in `tokenizer.ggml.pre`: how text is cut into words before BPE.

A vocabulary's merges were learned on words cut one way (Llama 3 keeps up to three digits together, Qwen2 one,
StarCoder splits every digit off first); cutting another way gives other token ids. The names are
llama.cpp's; each maps to the steps of the model's own tokenizer.json (a regex split, or several applied one after
the other, then the byte-level alphabet). A name not known here is refused, naming the field and the value, instead
of being read with GPT-2's split.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# Llama 3's split: contractions, letters, numbers of up to three digits, punctuation runs, newlines, spaces.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with every digit a word of its own.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks kept on their letters.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Seed-Coder's: Qwen2's, but a punctuation run takes no newline after it.
_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
               r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken: words split at a lower -> upper case change, one digit per word.
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k, also Llama 4's): tekken's case split with contractions kept on the word, up to three digits.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek LLM (67B/7B): newlines alone, Latin/Greek/Cyrillic/... letter runs with one leading space, ASCII and
# full-width punctuation runs, trailing spaces, CJK/Hangul runs, digit runs — each split in turn. Six letters are
# written as escapes: Unicode normalization folds them to other code points (U+1F7D -> U+03CE), which would turn
# their ranges backwards.
_DEEPSEEK_LLM_LETTERS = (
    "[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄ"
    "ῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲"
    "𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = ("[\r\n]", r"\s?" + _DEEPSEEK_LLM_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK_HANGUL,
                 r"\p{N}+")
# DeepSeek Coder: the same shape with Unicode classes, and one digit per word.
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
# DeepSeek V3 / R1: up to three digits, CJK/kana runs, then one regex for the rest.
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2 = "gpt2"  # ByteLevel's own regex (GPT-2's)
_DIGITS_THEN_GPT2 = "digits+gpt2"  # each digit split off, then GPT-2's regex
_FALCON = "falcon"  # punctuation runs, GPT-2's regex, digit runs, then every three digits

_SPLITS: dict[str, str | tuple[str, ...]] = {
    # smollm: llama.cpp splits digits first, but transformers' GGUF tokenizer (the reference the served model's
    # outputs are checked against) reads SmolLM GGUFs with GPT-2's split; the two differ on a space run before a digit.
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "smollm", "phi-2", "exaone4", "trillion",
                     "granite-docling"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "chatglm-bpe", "glm4"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "kormo", "megrez", "hunyuan", "grok-2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    "seed-coder": (_SEED_CODER,),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK_V3),
    "falcon": _FALCON,
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
    if kind == _FALCON:
        # Falcon's tokenizer.json: its digit steps run on byte-level text, where a digit is still itself. (llama.cpp
        # leaves out the digit-run step; the model's own tokenizer has it.)
        return pre_tokenizers.Sequence([pre_tokenizers.Punctuation(behavior="contiguous"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False),
                                        pre_tokenizers.Digits(individual_digits=False),
                                        pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated")])
    # Each regex cuts the pieces the one before it left; the bytes are respelled only at the end.
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in kind),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
