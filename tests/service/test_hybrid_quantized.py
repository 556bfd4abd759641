"""AWQ and GPTQ checkpoints of the hybrid families (Qwen3.5, Nemotron-H, Granite hybrid): every linear layer of the
decoder quantized the format's way (attention, MLP and the Mamba / DeltaNet projections, as AutoAWQ and GPTQModel
do), dequantized at load, the logits equal to transformers' on the dequantized model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.service import test_hybrid_families as hybrid
from tests.service.test_awq_model import awq_quantize
from tests.service.test_gptq_model import gptq_quantize

GROUP = 32


def _quantizable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The weights of the decoder's linear layers whose widths fit the formats' packing: the checkpoint's name of
    each (transformers renames some on save, Nemotron-H's `model.` to `backbone.`) to the module's."""
    by_value = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name and m.in_features % GROUP == 0 \
                and m.out_features % 8 == 0:
            (stored,) = [k for k, t in tensors.items() if t.shape == m.weight.shape and torch.equal(t, m.weight)]
            by_value[stored] = f"{name}.weight"
    return by_value


def _write(family: str, method: str, path) -> torch.nn.Module:
    hf = hybrid.make_checkpoint(family, path)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    dequantized = {}
    gen = torch.Generator().manual_seed(3)
    for name, param in sorted(_quantizable(hf, tensors).items()):
        w = tensors.pop(name).float()
        packed, dequantized[param] = awq_quantize(w, GROUP) if method == "awq" else \
            gptq_quantize(w, GROUP, sym=True, v2=False, act_order=False, gen=gen)
        tensors |= {name.removesuffix("weight") + k: v for k, v in packed.items()}
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                      "version": "gemm"} if method == "awq" else
                                     {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                      "sym": True})
    (path / "config.json").write_text(json.dumps(config))
    assert dequantized, "nothing was quantized"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return hf.float().eval()


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "granitemoehybrid"])
def test_quantized_hybrid_matches_the_dequantized_model(tmp_path, family, method):
    hf = _write(family, method, tmp_path)
    # The hybrid families' own check (two prompts in chunks of 7, each from its state slot), against this hf.
    hybrid.test_chunked_prefill_logits_match_hf((family, hf, tmp_path), 7)
