"""Text <-> token ids for the scheduler and the HTTP API, built on the HF `tokenizers` library.

Two sources:
- a GGUF file: the vocabulary, merges and special tokens live in the metadata (llama.cpp key names). A byte-level
  BPE one (`tokenizer.ggml.model` = gpt2) is assembled here, the same way transformers' GGUF converter does; a
  SentencePiece one (llama) is built by that converter (gguf_sentencepiece.py); any other model is refused;
- a HF model directory: `tokenizer.json` plus `tokenizer_config.json` for the chat template and BOS/EOS.

Chat templates are rendered with a sandboxed jinja2 environment configured like transformers'.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer

from common import gguf_cache
from common.gguf_pretokenizer import byte_level_pre_tokenizer
from common.gguf_sentencepiece import sentencepiece_tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a chat message may have, in every API

# llama.cpp token types (gguf.TokenType)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    # Printable latin-1 bytes stand for themselves; the rest are shifted past 255 so every byte has a
    # visible, non-whitespace character (the tokenizers library uses the same table).
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    shift = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bos_eos_processor(tokens: list[str], bos_id: int | None, eos_id: int | None, add_bos: bool,
                       add_eos: bool) -> processors.TemplateProcessing:
    """The model's own policy on BOS/EOS: what add_special_tokens=True adds around the text."""
    single, specials = "$A", []
    if add_bos and bos_id is not None:
        single = f"{tokens[bos_id]} {single}"
        specials.append((tokens[bos_id], bos_id))
    if add_eos and eos_id is not None:
        single = f"{single} {tokens[eos_id]}"
        specials.append((tokens[eos_id], eos_id))
    return processors.TemplateProcessing(single=single, special_tokens=list(dict.fromkeys(specials)))


@lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment shape as transformers: sandboxed (templates come from untrusted model files),
    # trim/lstrip blocks so `{% ... %}` lines leave no stray whitespace.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "<s>" or {"content": "<s>", ...}
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model facts the server needs (BOS/EOS, chat template)."""

    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None):
        self._tok = tokenizer
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template = chat_template

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """The tokenizer in a GGUF's metadata; kept in $LLMSERVE_GGUF_CACHE_DIR when that is set (parsing the
        metadata takes seconds)."""
        cached = gguf_cache.entry(path, "tokenizer.json")
        if cached is None:
            return cls._read_gguf(path)
        with gguf_cache.building(cached):
            if os.path.exists(cached):
                with open(cached, encoding="utf-8") as f:
                    saved = json.load(f)
                return cls(HFTokenizer.from_str(saved["tokenizer"]), bos_token_id=saved["bos_token_id"],
                           eos_token_id=saved["eos_token_id"], chat_template=saved["chat_template"])
            tokenizer = cls._read_gguf(path)
            saved = {"tokenizer": tokenizer.backend.to_str(), "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "chat_template": tokenizer.chat_template}
            gguf_cache.store(cached, lambda tmp: _write_json(tmp, saved))
            return tokenizer

    @classmethod
    def _read_gguf(cls, path: str) -> Tokenizer:
        reader = gguf.GGUFReader(path)
        model = _gguf_field(reader, "tokenizer.ggml.model")
        if model == "llama":
            return cls._read_sentencepiece_gguf(path, reader)
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model = {model!r} is not a tokenizer llmserve reads (known: "
                             "gpt2, byte-level BPE; llama, SentencePiece)")
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        token_types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type", [])
        merges: list[str] = _gguf_field(reader, "tokenizer.ggml.merges", [])
        bos_id = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
        add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
        add_eos = bool(_gguf_field(reader, "tokenizer.ggml.add_eos_token", False))

        # Vocab entries are normally already spelled in the byte alphabet; respell any that are not
        # (plain UTF-8 text) so BPE can find them.
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
            for i, tok in enumerate(tokens)
        }
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        tok = HFTokenizer(bpe)
        # Words are cut the way this vocabulary's merges were learned (`tokenizer.ggml.pre`).
        tok.pre_tokenizer = byte_level_pre_tokenizer(_gguf_field(reader, "tokenizer.ggml.pre"), path)
        tok.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>, ...) must match whole in text and be skippable when decoding.
        # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would
        # grow the vocab past the model's embedding size, so skip it (as transformers does).
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types, strict=False)
                   if ty == _TOKEN_CONTROL and set(t) <= alphabet]
        user_defined = [AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, token_types, strict=False)
                        if ty == _TOKEN_USER_DEFINED and t in vocab]
        tok.add_special_tokens(control)
        tok.add_tokens(user_defined)

        tok.post_processor = _bos_eos_processor(tokens, bos_id, eos_id, add_bos, add_eos)
        return cls(tok, bos_token_id=bos_id, eos_token_id=eos_id,
                   chat_template=_gguf_field(reader, "tokenizer.chat_template"))

    @classmethod
    def _read_sentencepiece_gguf(cls, path: str, reader: gguf.GGUFReader) -> Tokenizer:
        tok, _ = sentencepiece_tokenizer(path)
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        bos_id = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos = bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", True))
        add_eos = bool(_gguf_field(reader, "tokenizer.ggml.add_eos_token", False))
        tok.post_processor = _bos_eos_processor(tokens, bos_id, eos_id, add_bos, add_eos)
        return cls(tok, bos_token_id=bos_id, eos_token_id=eos_id,
                   chat_template=_gguf_field(reader, "tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        jinja_path = os.path.join(path, "chat_template.jinja")  # newer checkpoints keep it in its own file
        if chat_template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                chat_template = f.read()

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return tok.token_to_id(content) if content is not None else None

        # BOS/EOS insertion on encode is already described by tokenizer.json's post-processor.
        return cls(tok, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=chat_template)

    # ---------------------------------------------------------------- properties
    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens only adds what the post-processor says (BOS iff the model asks for it);
        # special tokens written in the text are always matched whole.
        # encode_batch, not encode: the same tokens, but it releases the GIL while it works, so a long prompt
        # tokenized in a worker thread does not stall the event loop of the API or the scheduler.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on (not tokenized)."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"message {i}: unknown chat role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"message {i} ({role}): content must be a string")
        special = {
            "bos_token": self._id_to_text(self._bos_token_id),
            "eos_token": self._id_to_text(self._eos_token_id),
        }
        template = _compile_chat_template(self._chat_template)
        return template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               **{**special, **kwargs})

    def _id_to_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a GGUF file or a HF model directory (one per path per process: loading takes seconds)."""
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_hf_dir(path)
