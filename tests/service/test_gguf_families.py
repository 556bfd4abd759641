"""GGUF for the families GGUF defines beyond the bundled Llama: a Qwen3 checkpoint written by transformers, and the
same weights written as a GGUF with the `gguf` package under llama.cpp's names and keys, load to the same model:
same config, same logits, same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from tests.service.test_model import PagedRunner
from tests.service.test_model_families import make_checkpoint, prompts
from worker_svc.model import families as models
from worker_svc.model.loader import load_model_weights

# HF name inside a layer -> llama.cpp's (Qwen3: no q/k row permutation, q/k norms per head)
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    kind, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER_NAMES[kind]}.{suffix}"


def write_qwen3_gguf(hf, path: str) -> None:
    c = hf.config
    w = GGUFWriter(path, "qwen3")
    w.add_name("qwen3-random")
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(gguf_name(name), np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_gguf_equals_safetensors(tmp_path):
    hf = make_checkpoint("qwen3", tmp_path / "hf")
    gguf_path = str(tmp_path / "qwen3.gguf")
    write_qwen3_gguf(hf, gguf_path)
    loaded = []
    for path in (str(tmp_path / "hf"), gguf_path):
        config, weights = load_model_weights(path)
        loaded.append(models.by_name(config.architecture)(config, weights, torch.float32, "cpu"))
    from_hf, from_gguf = loaded
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "tie_word_embeddings", "vocab_size"):
        assert getattr(from_gguf.config, field) == pytest.approx(getattr(from_hf.config, field)), field  # f32 in GGUF
    ids = prompts(hf.config.vocab_size)
    runners = [PagedRunner(m, num_blocks=32) for m in loaded]
    logits = [r.step(dict(enumerate(ids))) for r in runners]
    tokens: list[list[list[int]]] = [[], []]
    for _ in range(10):
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
        nxt = [x.argmax(-1).tolist() for x in logits]
        for k in range(2):
            tokens[k].append(nxt[k])
        logits = [r.step({i: [t] for i, t in enumerate(n)}) for r, n in zip(runners, nxt, strict=True)]
    assert tokens[0] == tokens[1]
