"""gpt-oss from transformers-written random checkpoints (float32, bfloat16, MXFP4 experts): logits per row equal
transformers' under chunked prefill on a paged pool (chunks of 1, 7 and 32: sinks and the sliding window seen across
chunk boundaries), greedy decode equal to its generate, the MXFP4 quantizer checked by transformers' own dequantize,
the eager path the runner takes, and the config.json / quantization_config fields that are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.service.test_model import PagedRunner
from tests.service.test_moe_models import _edit_config, chunked_logits
from tests.support import gpt_oss_checkpoints as gc
from tests.support import moe_checkpoints as mc
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir, load_model_weights
from worker_svc.model.mxfp4 import Mxfp4Weight
from worker_svc.parallel.sharding import Shard


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for kind, dtype, mxfp4 in (("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False),
                               ("mxfp4", torch.float32, True), ("mxfp4-bf16", torch.bfloat16, True)):
        path = str(tmp_path_factory.mktemp(kind))
        out[kind] = (path, gc.write_checkpoint(path, dtype, mxfp4=mxfp4))
    return out


def build(path: str, dtype: torch.dtype = torch.float32, prepack: bool | None = None, quantization=None):
    config, weights = load_model_weights(path, quantization=quantization)
    return models.by_name(config.architecture)(config, weights, dtype, "cpu", prepack=prepack)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def greedy(model, ids: list[int], n: int) -> list[int]:
    runner = PagedRunner(model, num_blocks=64, seed=3)
    tokens = [int(runner.step({0: ids})[0].argmax())]
    for _ in range(n - 1):
        tokens.append(int(runner.step({0: tokens[-1:]})[0].argmax()))
    return tokens


def test_config_layers_and_experts(checkpoints):
    path, hf = checkpoints["float32"]
    model = build(path, prepack=False)
    c = model.config
    assert c.architecture == "gpt_oss" and c.num_experts == 4 and c.num_experts_per_tok == 2
    assert c.layer_types == ["sliding_attention", "full_attention", "sliding_attention"] and c.sliding_window == 8
    assert c.rope_scaling["rope_type"] == "yarn" and (c.swiglu_alpha, c.swiglu_limit) == (1.702, 1.0)
    sliding = ["sinks", "sliding_window"]
    assert [sorted(k) for k in model.attn_kwargs] == [sliding, ["sinks"], sliding]
    ref = hf.model.layers[0]
    assert torch.equal(model.attn_kwargs[0]["sinks"], ref.self_attn.sinks.detach())
    block = model.layers[0].moe
    inter = c.moe_intermediate_size
    gate_up = ref.mlp.experts.gate_up_proj.detach()[1]  # [hidden, 2I], gate at even columns
    assert torch.equal(block.gate_up[1][:inter], gate_up[:, 0::2].T) and torch.equal(block.gate_up[1][inter:],
                                                                                      gate_up[:, 1::2].T)
    assert torch.equal(block.down[1], ref.mlp.experts.down_proj.detach()[1].T)
    assert torch.equal(block.router_bias, ref.mlp.router.bias.detach())


@pytest.mark.parametrize("prepack", [False, True], ids=["dense", "prepacked"])
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_prefill_matches_transformers(checkpoints, chunk, prepack):
    path, hf = checkpoints["float32"]
    model = build(path, prepack=prepack)
    prompts = gc.prompts(3, seed=7)
    for ids, got in zip(prompts, chunked_logits(model, prompts, chunk), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_greedy_decode_matches_transformers(checkpoints, kind):
    path, hf = checkpoints[kind]
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    model = build(path, dtype)
    compared = 0
    for ids in gc.prompts(3, seed=11):
        want = mc.clear_prefix(*mc.hf_greedy(hf, ids, 12), min_margin=1e-2 if kind == "float32" else 0.5)
        assert greedy(model, ids, 12)[:len(want)] == want
        compared += len(want)
    assert compared >= 12, "too few clear greedy steps to compare"


def test_runner_takes_the_eager_path(checkpoints):
    from worker_svc.config import CompilationConfig
    from worker_svc.cpu import layer_loop
    from worker_svc.model.compiled import CompiledForward

    model = build(checkpoints["float32"][0], prepack=False)
    assert not model.runs_llama_layers() and layer_loop.build(model) is None  # the C++ loop declines it
    with pytest.raises(ValueError, match="the compiled forward runs the Llama-shaped decoder only, not gpt_oss"):
        CompiledForward(model, CompilationConfig())


# ------------------------------------------------------------------------------------------------------------- MXFP4


def test_quantizer_round_trips_through_transformers_dequantize():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 96, 64, generator=g) * torch.logspace(-3, 2, 64)  # [E, in, out], blocks of many scales
    blocks, scales = gc.quantize_mxfp4(w.transpose(1, 2))
    assert blocks.shape == (2, 64, 3, 16) and scales.shape == (2, 64, 3)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out] again
    # Within a quarter of the block's absmax: half of e2m1's widest step (2) at the block's scale 2^e <= absmax / 4,
    # or the clip at 6 of a value below 8 * 2^e
    absmax = w.transpose(1, 2).reshape(2, 64, 3, 32).abs().amax(-1).repeat_interleave(32, -1).transpose(1, 2)
    assert ((theirs - w).abs() <= absmax / 4).all()
    # Quantizing the dequantized values gives the same bytes back: the grid holds them exactly.
    again = gc.quantize_mxfp4(theirs.transpose(1, 2))
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    # The served weight's own dequantize agrees with transformers' bit for bit, in float32 and bfloat16.
    for dtype in (torch.float32, torch.bfloat16):
        ours = Mxfp4Weight(blocks[1], scales[1]).dequantize(dtype)
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype)[1].T)


def test_mxfp4_experts_stay_packed(checkpoints):
    path, _ = checkpoints["mxfp4-bf16"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "mxfp4"
    model = build(path, torch.bfloat16, quantization="mxfp4")  # the flag agrees with the checkpoint
    block = model.layers[0].moe
    assert all(isinstance(t, Mxfp4Weight) for t in (*block.gate_up, *block.down))
    packed = sum(t.nbytes for t in (*block.gate_up, *block.down))
    dense = sum(2 * t.shape[0] * t.shape[1] for t in (*block.gate_up, *block.down))  # the same weights in bf16
    assert packed * 3 < dense  # 4.25 bits a value against 16


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_mxfp4_logits_match_transformers_on_the_dequantized_model(checkpoints, chunk):
    path, hf = checkpoints["mxfp4"]  # hf holds transformers' dequantize of the checkpoint's blocks
    model = build(path)  # detected from quantization_config, no flag
    prompts = gc.prompts(3, seed=7)
    for ids, got in zip(prompts, chunked_logits(model, prompts, chunk), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_mxfp4_bf16_greedy_matches_transformers(checkpoints):
    path, hf = checkpoints["mxfp4-bf16"]
    model = build(path, torch.bfloat16)
    compared = 0
    for ids in gc.prompts(3, seed=11):
        want = mc.clear_prefix(*mc.hf_greedy(hf, ids, 12), min_margin=0.5)
        assert greedy(model, ids, 12)[:len(want)] == want
        compared += len(want)
    assert compared >= 12, "too few clear greedy steps to compare"


# ---------------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("changes,message", [
    ({"swiglu_limit": 0}, "swiglu_limit must be a number > 0"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok must be an int in \[1, 4\]"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types must list sliding_attention or full_attention"),
    ({"sliding_window": None}, "sliding_window must be an int > 0"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='dynamic' is not supported"),
    ({"quantization_config": {"quant_method": "mxfp4", "group_size": 64}},
     "quantization_config.group_size=64 is not applied"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, changes, message):
    path = _edit_config(checkpoints["float32"][0], tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_dir(path)


def test_refusals_of_flags_and_layouts(checkpoints, tmp_path):
    path = checkpoints["float32"][0]
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: gpt_oss is not sharded yet"):
        load_hf_dir(path, Shard(0, 2))
    with pytest.raises(ValueError, match="--quantization mxfp4: the checkpoint has no quantization_config"):
        load_hf_dir(path, quantization="mxfp4")
    with pytest.raises(ValueError, match="--quantization fp8 does not match .*quant_method='mxfp4'"):
        load_hf_dir(checkpoints["mxfp4"][0], quantization="fp8")
    mixtral = str(tmp_path / "mixtral")
    mc.write_checkpoint("mixtral", mixtral)
    edited = _edit_config(mixtral, tmp_path / "mixtral-mxfp4", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quant_method='mxfp4' is applied to gpt-oss's experts only, not to mixtral"):
        load_hf_dir(edited)
