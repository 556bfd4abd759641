"""compressed-tensors `pack-quantized` W4A16 checkpoints (strategy group with 32 / 64 / 128 columns, symmetric and with
zero points; strategy channel) and `int-quantized` W8A8 checkpoints (int8 weights per channel or per tensor, dynamic
per-token int8 activations declared) written here from a random transformers Llama, quantized by the format's rules
(signed 4-bit codes plus 8 packed 8 per int32 along the input dim, zero points packed along the output dim, float16
scales), against transformers on the dequantized model: logits within a stated tolerance and greedy tokens equal
where transformers' top-2 margin is clear; the weights held as the int4 / int8 kernels' codes; the conversion
against dequantize-then-matmul."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import parse
from protos import worker_pb2 as pb
from tests.service.test_awq_model import PROJECTIONS, SHAPE
from tests.service.test_gptq_model import pack_columns, pack_rows
from tests.service.test_model import PagedRunner
from tests.service.test_model_families import make_checkpoint, prompts
from tests.support.dequantized_reference import assert_matches_dequantized
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model import families as models
from worker_svc.model import quant
from worker_svc.model.hf_compressed_int import int8_weight, packed_weight
from worker_svc.model.loader import load_hf_dir
from worker_svc.server import execute_step


def pack_quantize(w: torch.Tensor, group: int | None, sym: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(weight_packed, weight_scale, weight_shape[, weight_zero_point]) of w [out, in] by compressed-tensors'
    rules (group None: strategy channel), and the dequantized weight."""
    out, inp = w.shape
    size = group or inp
    g = w.reshape(out, inp // size, size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        scale = (torch.maximum(-lo, hi) / 7.5).clamp(min=1e-5).half()
        zero = torch.zeros_like(scale, dtype=torch.float32)
    else:
        scale = ((hi - lo) / 15).clamp(min=1e-5).half()
        zero = (torch.round(-lo / scale.float()) - 8).clamp(-8, 7)
    s = scale.float().unsqueeze(-1)
    q = torch.round(g / s + zero.unsqueeze(-1)).clamp(-8, 7)
    dequantized = ((q - zero.unsqueeze(-1)) * s).reshape(out, inp)
    tensors = {"weight_packed": pack_columns((q.reshape(out, inp) + 8).to(torch.uint8)), "weight_scale": scale,
               "weight_shape": torch.tensor([out, inp])}
    if not sym:
        tensors["weight_zero_point"] = pack_rows((zero + 8).to(torch.uint8))
    return tensors, dequantized


def int8_quantize(w: torch.Tensor, strategy: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(weight int8, weight_scale) of w [out, in] by compressed-tensors' symmetric int8 rules (absmax / 127 per
    channel or per tensor), and the dequantized weight."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 127).clamp(min=1e-8).half()
    q = torch.round(w / scale.float()).clamp(-128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": scale}, q * scale.float()


def compressed_config(group: int | None, sym: bool, int8: str | None = None) -> dict:
    """compressed-tensors' quantization_config: pack-quantized W4A16 (int8 None; group None: strategy channel), or
    int-quantized W8A8 with weight strategy `int8` and dynamic per-token int8 activations."""
    if int8 is None:
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax",
                   **({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})}
        acts = None
    else:
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": int8}
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if int8 is None else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write_checkpoint(path, group: int | None, sym: bool, int8: str | None = None) -> torch.nn.Module:
    """A pack-quantized checkpoint (int8 None), or an int-quantized one with weight strategy `int8`."""
    hf = make_checkpoint("llama", path, **SHAPE)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    dequantized = {}
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            w = tensors.pop(name).float()
            packed, dequantized[name] = pack_quantize(w, group, sym) if int8 is None else int8_quantize(w, int8)
            tensors |= {name.removesuffix("weight") + k: v for k, v in packed.items()}
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = compressed_config(group, sym, int8)
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return hf.float().eval()


CASES = [(32, True), (64, False), (128, True), (None, False)]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"{f'group{c[0]}' if c[0] else 'channel'}-{'sym' if c[1] else 'zp'}")
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("packed")
    hf = write_checkpoint(path, *request.param)
    config, weights = load_hf_dir(str(path))
    return hf, models.by_name(config.architecture)(config, weights, torch.float32, "cpu")


def test_weights_are_int4(pair):
    _, ours = pair
    for layer in ours.layers:
        for w in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            assert isinstance(w, quant.QuantLinear) and w.bits == 4 and w.source == "compressed-tensors"


@pytest.fixture(scope="module", params=["channel", "tensor"], ids=lambda s: f"int8-{s}")
def int8_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("int8")
    hf = write_checkpoint(path, None, True, int8=request.param)
    config, weights = load_hf_dir(str(path))
    return hf, models.by_name(config.architecture)(config, weights, torch.float32, "cpu")


def test_int8_weights_are_int8(int8_pair):
    _, ours = int8_pair
    for layer in ours.layers:
        for w in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            assert isinstance(w, quant.QuantLinear) and w.bits == 8 and w.source == "compressed-tensors"


def test_int8_logits_and_greedy_tokens_match_the_dequantized_model(int8_pair):
    assert_matches(*int8_pair)


def test_logits_and_greedy_tokens_match_the_dequantized_model(pair):
    assert_matches(*pair)


def assert_matches(hf, ours) -> None:
    assert_matches_dequantized(hf, ours)


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("sym", [True, False])
def test_conversion_matches_dequantize_then_matmul(group, sym):
    gen = torch.Generator().manual_seed(group or 1)
    w = torch.randn(96, 256, generator=gen)
    packed, dequantized = pack_quantize(w, group, sym)
    weight = packed_weight(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"],
                           packed.get("weight_zero_point"), "w")
    assert torch.allclose(weight.dequantize(), dequantized, atol=1e-6)
    x = torch.randn(5, 256, generator=gen)
    got = quant.QuantLinear(weight, torch.float32, torch.device("cpu"))(x)
    assert torch.allclose(got, x @ dequantized.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_int8_conversion_matches_dequantize_then_matmul(strategy):
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(96, 256, generator=gen)
    tensors, dequantized = int8_quantize(w, strategy)
    weight = int8_weight(tensors["weight"], tensors["weight_scale"], "w")
    assert torch.allclose(weight.dequantize(), dequantized, atol=1e-6)
    x = torch.randn(5, 256, generator=gen)
    got = quant.QuantLinear(weight, torch.float32, torch.device("cpu"))(x)
    assert torch.allclose(got, x @ dequantized.T, atol=1e-4, rtol=1e-4)


def test_the_worker_serves_an_int8_checkpoint_with_int8_activations(tmp_path):
    """Through the worker's own path (--quantization compressed-tensors --activation-quantization int8): every int8
    matmul makes its input's 32-groups int8, and chunked prefills beside decodes give each request the tokens of
    that model alone."""
    write_checkpoint(tmp_path, None, True, int8="channel")
    runner = ModelRunner(parse(WorkerConfig, ["--model", str(tmp_path), "--quantization", "compressed-tensors",
                                              "--activation-quantization", "int8", "--dtype", "float32",
                                              "--num-gpu-blocks-override", "64"]))
    reqs = [DriverRequest(f"r{i}", p, pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          arrival_step=2 * i) for i, p in enumerate(prompts(runner.config.vocab_size, (30, 17, 9)))]
    run_requests(partial(execute_step, runner), reqs, chunk=5, num_blocks=runner.num_blocks,
                 block_size=runner.block_size)
    config, weights = load_hf_dir(str(tmp_path))
    weights = quant.with_integer_activations(weights, 8, torch.device("cpu"))
    assert all(w.activation_bits == 8 for w in weights.values() if isinstance(w, quant.QuantizedWeight))
    alone = models.by_name(config.architecture)(config, weights, torch.float32, "cpu")
    for r in reqs:
        solo = PagedRunner(alone, 64)
        logits, tokens = solo.step({0: r.prompt_ids}), []
        for _ in range(5):
            tokens.append(int(logits[0].argmax()))
            logits = solo.step({0: [tokens[-1]]})
        assert r.output == tokens, r.request_id
