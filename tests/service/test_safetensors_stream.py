"""The HF loader reads a checkpoint one tensor at a time, each converted once to the dtype it is kept in."""

from __future__ import annotations

import glob
import os

import torch
import transformers

from tests.support.random_weights import randomize
from worker_svc.model.loader import load_hf_dir
from worker_svc.model.safetensors_stream import Placement, iter_tensors
from worker_svc.parallel.sharding import FULL, Shard, shard_tensor


def _checkpoint(tmp_path, dtype: torch.dtype) -> str:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize(model)
    model.to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def test_bf16_target_never_yields_float32_matrices(tmp_path):
    path = _checkpoint(tmp_path, torch.bfloat16)
    config, reference = load_hf_dir(path)  # the float32 placement: every tensor widened
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    stream = iter_tensors(files, config, FULL, Placement(torch.bfloat16))
    assert iter(stream) is stream  # a generator: nothing is read before it is asked for
    seen = 0
    for name, t in stream:
        want = torch.bfloat16 if t.dim() >= 2 else torch.float32  # norms stay float32
        assert t.dtype == want, name
        assert torch.equal(t.float(), reference[name]), name  # one conversion, the same values
        seen += 1
    assert seen == len(reference)


def test_float32_checkpoint_narrowed_once(tmp_path):
    path = _checkpoint(tmp_path, torch.float32)
    config, reference = load_hf_dir(path)
    _, weights = load_hf_dir(path, placement=Placement(torch.bfloat16))
    for name, t in weights.items():
        expected = reference[name].to(torch.bfloat16) if t.dim() >= 2 else reference[name]
        assert t.dtype == expected.dtype and torch.equal(t, expected), name


def test_shard_sliced_before_conversion(tmp_path):
    path = _checkpoint(tmp_path, torch.bfloat16)
    config, reference = load_hf_dir(path)
    shard = Shard(1, 2)
    _, weights = load_hf_dir(path, shard, placement=Placement(torch.bfloat16))
    for name, t in weights.items():
        expected = shard_tensor(name, reference[name], config, shard)
        assert t.shape == expected.shape and torch.equal(t.float(), expected), name

