"""GPTQ int4 checkpoints (groups of 32, 64 and 128; symmetric and with zero points; the original format's zeros
stored minus one and gptq_v2's; act-order) written here from a random transformers Llama, quantized by GPTQ's
rules (4-bit per group along the input dim, float16 scales, codes packed 8 per int32 along the input dim, zeros 8
per int32 along the output dim), against transformers on the dequantized model: logits within a stated tolerance
and greedy tokens equal where transformers' top-2 margin is clear; the weights held as the int4 kernels' codes
where the groups are runs of columns; the conversion against dequantize-then-matmul."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError, parse
from protos import worker_pb2 as pb
from tests.service.test_awq_model import PROJECTIONS, SHAPE
from tests.service.test_model import PagedRunner
from tests.service.test_model_families import make_checkpoint, prompts
from tests.support.dequantized_reference import assert_matches_dequantized
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model import families as models
from worker_svc.model import quant
from worker_svc.model.hf_gptq import gptq_weight, unpack_columns, unpack_rows
from worker_svc.model.loader import load_hf_dir
from worker_svc.server import execute_step


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] -> int32 [rows / 8, cols], nibble i of row k holding row 8k + i."""
    c = codes.to(torch.int32).reshape(-1, 8, codes.shape[1])
    return sum(c[:, i] << (4 * i) for i in range(8)).to(torch.int32).contiguous()


def pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] -> int32 [rows, cols / 8], nibble i of column k holding column 8k + i."""
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 8)
    return sum(c[..., i] << (4 * i) for i in range(8)).to(torch.int32).contiguous()


def gptq_quantize(w: torch.Tensor, group: int, sym: bool, v2: bool, act_order: bool,
                  gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(qweight, qzeros, scales, g_idx) of w [out, in] by GPTQ's rules, and the dequantized weight. Act-order: the
    columns are quantized in a random order (GPTQ's is by the Hessian's diagonal), so g_idx is that order's groups."""
    out, inp = w.shape
    order = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group).to(torch.int32)
    wt = w.T  # [in, out]
    groups = inp // group
    scales = torch.empty(groups, out)
    zeros = torch.empty(groups, out)
    for g in range(groups):
        cols = wt[g_idx == g]
        lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
        if sym:
            scales[g] = (torch.maximum(-lo, hi).clamp(min=1e-5) * 2 / 15)
            zeros[g] = 8
        else:
            scales[g] = (hi - lo).clamp(min=1e-5) / 15
            zeros[g] = torch.round(-lo / scales[g].half().float()).clamp(0, 15)
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = torch.round(wt / s + z).clamp(0, 15)
    dequantized = ((q - z) * s).T.contiguous()
    stored = zeros if v2 else zeros - 1
    tensors = {"qweight": pack_rows(q.to(torch.uint8)), "qzeros": pack_columns(stored.to(torch.uint8)),
               "scales": scales, "g_idx": g_idx}
    return tensors, dequantized


def gptq_config(group: int, sym: bool, v2: bool, act_order: bool) -> dict:
    """GPTQ's quantization_config (AutoGPTQ's fields; gptq_v2 stores the zeros as they are)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
            "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq_v2" if v2 else "gptq"}


def write_gptq_checkpoint(path, group: int, sym: bool, v2: bool, act_order: bool) -> torch.nn.Module:
    hf = make_checkpoint("llama", path, **SHAPE)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(group)
    dequantized = {}
    for name in sorted(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            packed, dequantized[name] = gptq_quantize(tensors.pop(name).float(), group, sym, v2, act_order, gen)
            tensors |= {name.removesuffix("weight") + k: v for k, v in packed.items()}
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = gptq_config(group, sym, v2, act_order)
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return hf.float().eval()


# (group, sym, gptq_v2, act-order)
CASES = [(32, True, False, False), (64, False, False, False), (128, False, True, False), (128, True, False, True)]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"group{c[0]}-{'sym' if c[1] else 'zp'}-{'v2' if c[2] else 'v1'}"
                              f"{'-actorder' if c[3] else ''}")
def pair(request, tmp_path_factory):
    group, sym, v2, act_order = request.param
    path = tmp_path_factory.mktemp(f"gptq{group}")
    hf = write_gptq_checkpoint(path, group, sym, v2, act_order)
    config, weights = load_hf_dir(str(path))
    return request.param, hf, models.by_name(config.architecture)(config, weights, torch.float32, "cpu")


def test_weights_are_int4_unless_act_order_mixes_groups(pair):
    (_, _, _, act_order), _, ours = pair
    for layer in ours.layers:
        for w in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            if act_order:  # a random column order puts two groups in (nearly) every 32-column run: dense
                assert not isinstance(w, quant.QuantLinear)
            else:
                assert isinstance(w, quant.QuantLinear) and w.bits == 4 and w.source == "gptq"


def test_logits_and_greedy_tokens_match_the_dequantized_model(pair):
    assert_matches_dequantized(*pair[1:])


def test_unpacking_inverts_the_packing():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 96), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_rows(pack_rows(codes)), codes)
    assert torch.equal(unpack_columns(pack_columns(codes)), codes)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_conversion_matches_dequantize_then_matmul(group, sym):
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(96, 256, generator=gen)
    packed, dequantized = gptq_quantize(w, group, sym, v2=False, act_order=False, gen=gen)
    weight = gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 1, "w")
    assert isinstance(weight, quant.QuantizedWeight)
    assert torch.allclose(weight.dequantize(), dequantized, atol=1e-6)
    x = torch.randn(5, 256, generator=gen)
    got = quant.QuantLinear(weight, torch.float32, torch.device("cpu"))(x)
    assert torch.allclose(got, x @ dequantized.T, atol=1e-4, rtol=1e-4)


def test_act_order_is_exact_where_runs_keep_one_group_and_dequantized_otherwise():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 256, generator=gen)
    packed, dequantized = gptq_quantize(w, 128, True, v2=False, act_order=True, gen=gen)
    mixed = gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 1, "w")
    assert isinstance(mixed, torch.Tensor) and torch.allclose(mixed, dequantized, atol=1e-6)
    # The groups reordered by whole 32-runs (the second half's groups first): still exact int4.
    g_idx = (torch.arange(256) // 128).flip(0).to(torch.int32)
    weight = gptq_weight(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, 1, "w")
    assert isinstance(weight, quant.QuantizedWeight)
    g = g_idx.long()
    zeros = unpack_columns(packed["qzeros"]).float() + 1
    want = (unpack_rows(packed["qweight"]).float() - zeros[g]) * packed["scales"].float()[g]
    assert torch.allclose(weight.dequantize(), want.T, atol=1e-6)


def test_the_worker_serves_a_gptq_checkpoint(tmp_path):
    """Through the worker's own path (ModelRunner, --quantization gptq agreeing with the checkpoint): chunked
    prefills beside decodes give each request the int4 model's greedy tokens alone; the compiled forward, which
    runs dense weights only, is refused at start for the checkpoint's int4 weights."""
    write_gptq_checkpoint(tmp_path, 64, False, False, False)
    runner = ModelRunner(parse(WorkerConfig, ["--model", str(tmp_path), "--quantization", "gptq", "--dtype",
                                              "float32", "--num-gpu-blocks-override", "64"]))
    reqs = [DriverRequest(f"r{i}", p, pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          arrival_step=2 * i) for i, p in enumerate(prompts(runner.config.vocab_size, (30, 17, 9)))]
    run_requests(partial(execute_step, runner), reqs, chunk=5, num_blocks=runner.num_blocks,
                 block_size=runner.block_size)
    config, weights = load_hf_dir(str(tmp_path))
    alone = models.by_name(config.architecture)(config, weights, torch.float32, "cpu")
    for r in reqs:
        solo = PagedRunner(alone, 64)
        logits, tokens = solo.step({0: r.prompt_ids}), []
        for _ in range(5):
            tokens.append(int(logits[0].argmax()))
            logits = solo.step({0: [tokens[-1]]})
        assert r.output == tokens, r.request_id
    with pytest.raises(ConfigError, match="--optimization-level 1 runs dense weights only"):
        ModelRunner(parse(WorkerConfig, ["--model", str(tmp_path), "-O1", "--num-gpu-blocks-override", "64"]))
