"""A config.json option the model or attention backend would ignore is refused when the checkpoint loads (at
worker start), naming the field: never a silently different output."""

from __future__ import annotations

import json

import pytest

from worker_svc.model.loader import load_hf_dir

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def refusal(tmp_path, architecture: str, **fields) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **BASE, **fields}))
    with pytest.raises(ValueError) as info:
        load_hf_dir(str(tmp_path))
    return str(info.value)


@pytest.mark.parametrize("architecture,fields,named", [
    ("FalconForCausalLM", {}, "architectures=['FalconForCausalLM']"),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ("Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}},
     "rope_parameters.rope_type='dynamic'"),
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("MistralForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
    ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("Gemma3ForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("Qwen2ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    # quantization_config: a method, or a field value within a known one, that the loader does not apply.
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}, "bits=8"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 16}},
     "group_size=16"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}},
     "checkpoint_format='marlin'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "gptq", "bits": 4, "lm_head": True}},
     "lm_head=True"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}}, "bits=8"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 16}},
     "group_size=16"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                  "version": "gemv"}}, "version='gemv'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method='bitsandbytes'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
     "activation_scheme='static'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt='e5m2'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "weight_block_size=[128]"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8", "kv_cache_quant_method": "x"}},
     "kv_cache_quant_method='x'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors",
                                                  "format": "nvfp4-pack-quantized"}},
     "format='nvfp4-pack-quantized'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 4, "type": "int", "strategy": "group",
                                                      "group_size": 48, "symmetric": True, "dynamic": False}}}}},
     "config_groups.group_0.weights.group_size=48"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 8, "type": "int", "strategy": "channel",
                                                      "symmetric": True, "dynamic": False}}}}},
     "config_groups.group_0.weights.num_bits=8"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 8, "type": "int", "strategy": "channel",
                                                      "symmetric": False, "dynamic": False}}}}},
     "config_groups.group_0.weights.symmetric=False"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 8, "type": "int", "strategy": "channel",
                                                      "symmetric": True, "dynamic": False},
                                                      "input_activations": {"num_bits": 8, "type": "int",
                                                                            "dynamic": False}}}}},
     "config_groups.group_0.input_activations.dynamic=False"),
    ("LlamaForCausalLM", {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8}}},
     "kv_cache_scheme={'num_bits': 8}"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 8, "type": "float", "strategy": "group",
                                                      "symmetric": True, "dynamic": False}}}}},
     "config_groups.group_0.weights.strategy='group'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                  "config_groups": {"group_0": {"weights": {
                                                      "num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "symmetric": True, "dynamic": False},
                                                      "input_activations": {"num_bits": 8, "type": "float",
                                                                            "dynamic": False}}}}},
     "config_groups.group_0.input_activations.dynamic=False"),
])
def test_refused_naming_the_field(tmp_path, architecture, fields, named):
    message = refusal(tmp_path, architecture, **fields)
    assert named in message and "config.json" in message, message


@pytest.mark.parametrize("fields,flag,named", [
    ({}, "fp8", "--quantization fp8: the checkpoint has no quantization_config"),
    ({"quantization_config": {"quant_method": "fp8"}}, "compressed-tensors",
     "--quantization compressed-tensors does not match the checkpoint's quantization_config.quant_method='fp8'"),
])
def test_a_quantization_flag_the_checkpoint_does_not_match_is_refused(tmp_path, fields, flag, named):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **BASE, **fields}))
    with pytest.raises(ValueError) as info:
        load_hf_dir(str(tmp_path), quantization=flag)
    assert named in str(info.value), info.value
