"""Tiny random-weight Mixtral and Qwen3-MoE checkpoints written by transformers, and transformers' greedy
tokens with the margin of each choice (tests compare greedy tokens only where that margin is clear)."""

from __future__ import annotations

import torch

from tests.support.random_weights import randomize

FAMILIES = ("mixtral", "qwen3_moe")
VOCAB = 256


def hf_model(family: str, **overrides) -> torch.nn.Module:
    """2 layers (Qwen3-MoE: 3, the middle one a dense MLP via `mlp_only_layers`), 4 experts, top-2, hidden 64;
    seeded random weights, the embedding and LM head 10x larger so that greedy choices are clear."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, num_experts_per_tok=2, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=None)  # no EOS: generation runs to max_new_tokens
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": 96, "num_hidden_layers": 2,
                                            "num_local_experts": 4, **overrides})
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "intermediate_size": 80, "moe_intermediate_size": 48,
                                             "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 4,
                                             "head_dim": 32, "norm_topk_prob": True, **overrides})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.config._experts_implementation = "eager"  # transformers' reference loop over experts
    randomize(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (model.model.embed_tokens.weight, model.lm_head.weight):
            p.copy_(torch.randn(p.shape, generator=g))
    return model.eval()


def write_checkpoint(family: str, path: str, **overrides) -> torch.nn.Module:
    """Save `hf_model(family)` as safetensors + config.json in `path`, with a byte-level tokenizer of the model's
    256 tokens (the scheduler detokenizes what it streams); returns the model."""
    import os

    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    model = hf_model(family, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    return model


def prompts(count: int, seed: int = 0, lengths: tuple[int, ...] = (5, 40, 17, 70, 9, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and, per step, the gap between its best and second-best logit."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    margins = []
    for step in out.logits:
        top2 = step[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def clear_prefix(tokens: list[int], margins: list[float], min_margin: float = 1e-2) -> list[int]:
    """The greedy tokens up to the first step whose top-2 margin is below `min_margin` (after that step a
    rounding difference may pick the other token and the continuations part)."""
    for i, m in enumerate(margins):
        if m < min_margin:
            return tokens[:i]
    return tokens
