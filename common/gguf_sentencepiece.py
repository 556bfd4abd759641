"""A SentencePiece GGUF's tokenizer (`tokenizer.ggml.model` = "llama": Llama 1/2, Mistral v0.1, Gemma, Phi-3 ...).

Such a file keeps the pieces, their scores and token types (`<0xXX>` byte pieces for byte fallback), and no merges.
transformers' GGUF converter rebuilds the vocabulary, the merges (from the scores: the pair whose joined piece
scores highest merges first, as SentencePiece's BPE does) and the control / user-defined tokens; it is used here as
it is. What is set here is how a space is written, the way SentencePiece itself does it: every space becomes "▁"
and, with `tokenizer.ggml.add_space_prefix` (true unless the file says otherwise), one more "▁" starts the text,
even text that starts with a space (transformers' `Metaspace` form skips it there).
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers

_SPACE = "▁"


def sentencepiece_tokenizer(path: str) -> tuple[HFTokenizer, dict]:
    """The tokenizer of the SentencePiece GGUF at `path` (BOS/EOS not yet added on encode) and the file's tokenizer
    fields as transformers reads them (`add_bos_token`, `bos_token`, ...)."""
    try:  # lazy: only a SentencePiece GGUF needs it, and an API-only install may not have it
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_SENTENCEPIECE_BUILDERS,
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError as e:
        raise RuntimeError(f"{path}: a SentencePiece GGUF's tokenizer is rebuilt by transformers, which is not "
                           "installed here (it comes with the `worker` extra: pip install 'llmserve[worker]')") from e

    architecture, fields, tokenizer_config = get_gguf_tokenizer(path)
    tok, _ = convert_gguf_tokenizer(architecture, fields)
    if architecture not in GGUF_SENTENCEPIECE_BUILDERS:  # Gemma and Phi-3 files get their family's own shape
        prefix = fields.get("add_prefix_space", True)
        steps = [normalizers.Prepend(_SPACE)] if prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
        tok.pre_tokenizer = None
        undo = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*undo, *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return tok, tokenizer_config
