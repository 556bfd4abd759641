"""Tiny random-weight gpt-oss checkpoints written by transformers (bfloat16 / float32, or with MXFP4 experts
quantized here by the format's rules), and a byte-level tokenizer carrying the harmony special tokens."""

from __future__ import annotations

import json
import os

import torch

from tests.support.random_weights import randomize

BYTES = 256
# The harmony format's special tokens (ids after the 256 byte tokens; gpt-oss's own ids are 199998 and up).
SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>")
VOCAB = 272  # bytes, the specials, padding rows


def hf_model(dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """3 layers (sliding, full, sliding: window 8), 4 experts, top-2, hidden 64, YaRN rope; seeded random weights,
    sinks of unit scale (so they move the softmax), the clamp low enough to bite, the embedding and LM head 10x
    larger so that greedy choices are clear."""
    import transformers

    cfg = transformers.GptOssConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=512, swiglu_limit=1.0, tie_word_embeddings=False, bos_token_id=None,
               eos_token_id=None,  # no EOS: generation runs to max_new_tokens
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
        **overrides})
    cfg._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(cfg)
    model.config._experts_implementation = "eager"  # transformers' reference loop over experts
    randomize(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (model.model.embed_tokens.weight, model.lm_head.weight):
            p.copy_(torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model.to(dtype).eval()


def write_tokenizer(path: str, chat_template: str | None = None) -> None:
    """A byte-level BPE of the 256 bytes plus the harmony specials (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
              "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_checkpoint(path: str, dtype: torch.dtype = torch.float32, mxfp4: bool = False,
                     chat_template: str | None = None, **overrides) -> torch.nn.Module:
    """Save `hf_model` in `path` with the tokenizer; returns the model. With `mxfp4`, the experts are stored
    quantized (`quantize_mxfp4`) as gpt-oss's checkpoints are, and the returned model holds their dequantized values
    (transformers' own dequantize): the reference the served model must equal."""
    model = hf_model(dtype, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, chat_template)
    if mxfp4:
        _quantize_experts(path, model)
    return model


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., in / 32, 16], scales uint8 [..., in / 32]) of w [..., in] by the OCP MX rules: per 32
    values the shared exponent is floor(log2(absmax)) - 2 (e2m1's largest exponent), each value divided by 2^exponent
    and rounded to the nearest e2m1 value (clamped to +-6), the low nibble holding the even index."""
    from worker_svc.model.mxfp4 import E2M1_VALUES

    *lead, n = w.shape
    groups = w.float().reshape(*lead, n // 32, 32)
    absmax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = torch.floor(torch.log2(absmax)) - 2
    scaled = (groups / torch.exp2(exponent)).clamp(-6.0, 6.0)
    grid = torch.tensor(E2M1_VALUES[:8])
    magnitude = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    codes = (magnitude + 8 * torch.signbit(scaled)).to(torch.uint8)  # -0 keeps its sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def _quantize_experts(path: str, model: torch.nn.Module) -> None:
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            stored = tensors.pop(name)  # [E, in, out]: quantized along `in` per output row
            blocks, scales = quantize_mxfp4(stored.transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():  # the reference holds what transformers' loader makes of the blocks
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=stored.dtype))
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def prompts(count: int, seed: int = 0, lengths: tuple[int, ...] = (5, 40, 17, 70, 9, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, BYTES, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]
