"""AWQ int4 checkpoints (AutoAWQ's GEMM layout, groups of 32, 64 and 128) written here from a random transformers
Llama, quantized by AWQ's rules (asymmetric 4-bit per group along the input dim, float16 scales, codes packed 8 per
int32 in the order 0 2 4 6 1 3 5 7), against transformers on the dequantized model: logits within a stated
tolerance and greedy tokens equal where transformers' top-2 margin is clear; the weights held as the int4 kernels'
codes; the unpacking against the packing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.service.test_model_families import make_checkpoint
from tests.support.dequantized_reference import assert_matches_dequantized
from worker_svc.model import families as models
from worker_svc.model import quant
from worker_svc.model.hf_awq import awq_weight, unpack_awq
from worker_svc.model.loader import load_hf_dir

SHAPE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The int4 kernels hold the checkpoint's values (scale * q - zero * scale in float32 against (q - zero) * scale):
# in float32 the logits differ from transformers' by summation order and that rounding (measured max 1.3e-4 over the
# three group sizes, every top-2 margin above 0.11).


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] -> int32 [rows, cols / 8] in AWQ's order."""
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 8)
    packed = torch.zeros(c.shape[:2], dtype=torch.int32)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= c[..., column] << (4 * nibble)
    return packed


def awq_quantize(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(qweight, qzeros, scales) of w [out, in] by AWQ's rules, and the dequantized weight."""
    out, inp = w.shape
    g = w.T.reshape(inp // group, group, out)  # groups along the input dim
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float().unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, 15)
    dequantized = ((q - zeros.unsqueeze(1)) * scales.float().unsqueeze(1)).reshape(inp, out).T
    tensors = {"qweight": pack_awq(q.reshape(inp, out).to(torch.uint8)), "qzeros": pack_awq(zeros.to(torch.uint8)),
               "scales": scales}
    return tensors, dequantized.contiguous()


def awq_config(group: int) -> dict:
    """AutoAWQ's quantization_config for the GEMM layout."""
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def write_awq_checkpoint(path, group: int) -> torch.nn.Module:
    hf = make_checkpoint("llama", path, **SHAPE)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    dequantized = {}
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            packed, dequantized[name] = awq_quantize(tensors.pop(name).float(), group)
            tensors |= {name.removesuffix("weight") + k: v for k, v in packed.items()}
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = awq_config(group)
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return hf.float().eval()


@pytest.fixture(scope="module", params=[32, 64, 128], ids=lambda g: f"group{g}")
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"awq{request.param}")
    hf = write_awq_checkpoint(path, request.param)
    config, weights = load_hf_dir(str(path))
    return hf, models.by_name(config.architecture)(config, weights, torch.float32, "cpu")


def test_weights_are_int4(pair):
    _, ours = pair
    for layer in ours.layers:
        for w in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            assert isinstance(w, quant.QuantLinear) and w.bits == 4 and w.source == "awq"


def test_logits_and_greedy_tokens_match_the_dequantized_model(pair):
    assert_matches_dequantized(*pair)


def test_unpacking_inverts_the_packing_and_dequantizes_exactly():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 96), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_awq(pack_awq(codes)), codes)
    w = torch.randn(96, 256, generator=gen)
    packed, dequantized = awq_quantize(w, 128)
    weight = awq_weight(packed["qweight"], packed["qzeros"], packed["scales"], "w")
    assert torch.allclose(weight.dequantize(), dequantized, atol=1e-6)
