"""Model + loader parity with Hugging Face transformers (the correctness oracle), real weights, CPU.

The bundled GGUF is loaded twice, by our loader and by transformers, and both must agree on logits and
greedy tokens. Small random Llama / Qwen2 checkpoints cover the HF-directory loader, GQA, llama3 rope
scaling, an untied head and attention biases.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

import kernels
from tests.support.random_weights import randomize
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import default_model_path, load_gguf, load_hf_dir, load_model_weights

BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far, far away, there lived a young dragon who",
    "List three primary colors:",
]


class PagedRunner:
    """Minimal engine over our model: per-sequence block tables drawn from a shuffled pool."""

    def __init__(self, model: LlamaModel, num_blocks: int, seed: int = 0):
        self.model = model
        self.kv = torch.full(model.kv_cache_shape(num_blocks, BLOCK_SIZE), float("nan"), dtype=model.dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order physical blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False) -> torch.Tensor:
        """Append `chunks[seq_id]` tokens to each sequence in one forward; return last-row logits
        per sequence (or logits of every row)."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for sid, tokens in chunks.items():
            start = self.lengths.get(sid, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            self.lengths[sid] = end
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        meta = kernels.build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
        if all_logits:
            rows = torch.arange(len(ids))
        else:
            rows = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.forward(torch.tensor(ids), torch.tensor(positions), self.kv, meta, rows)


# ------------------------------------------------------------------------------------ bundled GGUF


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path) -> LlamaModel:
    config, weights = load_model_weights(gguf_path)
    return LlamaModel(config, weights, torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf(hf_tokenizer, hf_model):
    return hf_tokenizer, hf_model  # the session's (tests/conftest.py): transformers loading the same GGUF


@pytest.fixture(scope="module")
def prompt_ids(hf) -> list[list[int]]:
    tokenizer, _ = hf
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_gguf_config_matches_bundled_model(gguf_path):
    config, weights = load_gguf(gguf_path)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 100000.0)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    assert config.max_position_embeddings == 8192
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_batched_prefill_matches_hf(ours, hf, prompt_ids):
    _, model = hf
    runner = PagedRunner(ours, num_blocks=64)
    logits = runner.step(dict(enumerate(prompt_ids)))
    assert logits.shape == (len(prompt_ids), 49152) and logits.dtype == torch.float32
    for i, ids in enumerate(prompt_ids):
        diff = (logits[i] - hf_last_logits(model, ids)).abs().max().item()
        assert diff < 1e-3, f"prompt {i}: max abs logit diff {diff}"


def test_chunked_prefill_mixed_with_decode_matches_hf(ours, hf, prompt_ids):
    _, model = hf
    long_ids, short_ids = prompt_ids[2], prompt_ids[0]
    runner = PagedRunner(ours, num_blocks=64, seed=1)
    # Step 1: the first 7 tokens of the long prompt next to a whole short prompt.
    first = runner.step({0: long_ids[:7], 1: short_ids})
    next_token = int(first[1].argmax())
    # Step 2: the rest of the long prompt (which must see its cached chunk) next to a decode token.
    second = runner.step({0: long_ids[7:], 1: [next_token]})
    diff_chunk = (second[0] - hf_last_logits(model, long_ids)).abs().max().item()
    diff_decode = (second[1] - hf_last_logits(model, short_ids + [next_token])).abs().max().item()
    assert diff_chunk < 1e-3 and diff_decode < 1e-3, (diff_chunk, diff_decode)

    # The chunked result equals a one-shot prefill of the same prompt.
    whole = PagedRunner(ours, num_blocks=64, seed=2).step({0: long_ids})
    assert (whole[0] - second[0]).abs().max().item() < 1e-4


def test_greedy_decode_matches_hf_generate(ours, hf, prompt_ids):
    _, model = hf
    num_new = 8
    batch = {i: prompt_ids[i] for i in (1, 3)}
    runner = PagedRunner(ours, num_blocks=64, seed=3)
    generated: dict[int, list[int]] = {i: [] for i in batch}
    logits = runner.step(batch)
    for _ in range(num_new):
        tokens = logits.argmax(-1).tolist()
        for sid, tok in zip(batch, tokens, strict=True):
            generated[sid].append(tok)
        logits = runner.step({sid: [generated[sid][-1]] for sid in batch})

    for sid, ids in batch.items():
        with torch.no_grad():
            mask = torch.ones(1, len(ids), dtype=torch.long)
            out = model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=num_new,
                                 do_sample=False)
        assert generated[sid] == out[0, len(ids):].tolist()


# ------------------------------------------------------------------------- random HF checkpoints


def _check_hf_dir_parity(hf_model, tmp_path) -> LlamaModel:
    randomize(hf_model)
    hf_model.eval().save_pretrained(tmp_path, safe_serialization=True)
    config, weights = load_hf_dir(str(tmp_path))
    model = LlamaModel(config, weights, torch.float32, "cpu")

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (37, 21)]
    runner = PagedRunner(model, num_blocks=16)
    logits = runner.step(dict(enumerate(prompts)), all_logits=True)
    start = 0
    for ids in prompts:
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0].float()
        diff = (logits[start:start + len(ids)] - expected).abs().max().item()
        assert diff < 1e-4, f"max abs logit diff {diff}"
        start += len(ids)
    return model


def test_hf_llama_dir_with_llama3_rope_matches_hf(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=False, eos_token_id=[2, 3], bos_token_id=1,
    )
    torch.manual_seed(0)
    model = _check_hf_dir_parity(transformers.LlamaForCausalLM(config), tmp_path)
    c = model.config
    assert c.architecture == "llama" and c.num_kv_heads == 2 and c.head_dim == 16
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert not c.tie_word_embeddings and c.eos_token_ids == [2, 3]


def test_hf_qwen2_dir_with_bias_matches_hf(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=5,
    )
    torch.manual_seed(0)
    model = _check_hf_dir_parity(transformers.Qwen2ForCausalLM(config), tmp_path)
    c = model.config
    assert c.architecture == "qwen2" and c.tie_word_embeddings and c.eos_token_ids == [5]
    assert model.layers[0].qkv_bias is not None and model.layers[0].qkv_bias.shape == (64 + 2 * 32,)


def test_load_model_weights_rejects_unknown_path(tmp_path):
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model_weights(str(tmp_path))
