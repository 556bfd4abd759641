"""FP8 checkpoints (vLLM's `fp8` with 128x128 block scales or a per-tensor scale; compressed-tensors'
`float-quantized` per tensor, channel or block) written here from a random transformers Llama, quantized by the
format's own rules (amax / 448 scales), against transformers on the dequantized model: logits within a stated
tolerance and greedy tokens equal where transformers' top-2 margin is clear; each projection kept FP8 (on the CPU
run by the project's FP8 kernel; dequantized into --dtype as it loads where that kernel is absent); the FP8 matmul
against dequantize-then-matmul; -O1 on the CPU serving the checkpoint dense with the same tokens as -O0."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import parse
from protos import worker_pb2 as pb
from tests.e2e.test_startup_validation import assert_fails, run_cli
from tests.service.test_model import PagedRunner
from tests.service.test_model_families import make_checkpoint, prompts
from tests.support.dequantized_reference import assert_matches_dequantized
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model import families as models
from worker_svc.model import quant
from worker_svc.model.hf_quant import fp8_weight, runs_as_fp8
from worker_svc.model.loader import load_hf_dir
from worker_svc.model.safetensors_stream import Placement
from worker_svc.server import execute_step

FP8_MAX = 448.0  # float8_e4m3fn's largest value
# Shapes with partial 128-blocks (k / v 128 rows, gate / up 320, down 320 columns).
SHAPE = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model holds the checkpoint's dequantized values exactly, so in float32 only the summation order differs
# from transformers (measured max |logit difference| 1.3e-4 over the five formats, every top-2 margin above 0.16).


def fp8_quantize(w: torch.Tensor, strategy: str, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, scale) with scale = amax / 448 per tensor, per output row or per block x block."""
    out, inp = w.shape
    if strategy == "tensor":
        scale = w.abs().amax().reshape(1) / FP8_MAX
        full = scale.expand(out, inp)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand(out, inp)
    else:
        rb, cb = -(-out // block), -(-inp // block)
        padded = torch.zeros(rb * block, cb * block)
        padded[:out, :inp] = w.abs()
        scale = padded.view(rb, block, cb, block).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return (w / full).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, strategy: str, block: int = 128) -> torch.Tensor:
    out, inp = codes.shape
    if strategy == "block":
        scale = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return codes.float() * scale


# name -> (quantization_config, scale tensor suffix, strategy)
FORMATS = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  "weight_scale_inv", "block"),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_scale", "tensor"),
    **{f"compressed_{s}": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                            "quantization_status": "compressed", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 8, "type": "float", "strategy": s, "symmetric": True, "dynamic": False,
                                **({"block_structure": [128, 128]} if s == "block" else {})},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": True}}}},
                           "weight_scale", s) for s in ("tensor", "channel", "block")},
}


def write_fp8_checkpoint(path, fmt: str, shape: dict = SHAPE) -> torch.nn.Module:
    """The checkpoint at `path` in format `fmt`, and transformers' model holding its dequantized weights."""
    qconfig, suffix, strategy = FORMATS[fmt]
    hf = make_checkpoint("llama", path, **shape)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    dequantized = {}
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            codes, scale = fp8_quantize(tensors[name].float(), strategy)
            tensors[name], tensors[name.removesuffix("weight") + suffix] = codes, scale
            dequantized[name] = dequantize(codes, scale, strategy)
    save_file(tensors, file)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    return hf.float().eval()


@pytest.fixture(scope="module", params=list(FORMATS))
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_fp8_checkpoint(path, request.param)


@pytest.fixture(scope="module")
def pair_path(written):
    return written[0]


@pytest.fixture(scope="module")
def pair(written):
    path, hf = written
    config, weights = load_hf_dir(str(path))
    return hf, models.by_name(config.architecture)(config, weights, torch.float32, "cpu")


def test_the_cpu_loader_keeps_each_projection_fp8_where_the_kernel_runs(pair, request, monkeypatch):
    """On the CPU with the project's FP8 kernel built, each FP8 projection stays FP8 (the checkpoint's codes and
    scales, one byte a value) and the model runs it through quant.QuantLinear's kernel; without the kernel it is
    dequantized into the placement's dtype as it is read, its codes freed before the next tensor: the checkpoint's
    dequantized values exactly, rounded to the dtype, on dense matmuls. A hybrid family's are dense everywhere."""
    _, ours = pair
    path = request.getfixturevalue("pair_path")
    stored = load_file(next(path.glob("*.safetensors")))
    assert quant.cpu_kernels() is not None and hasattr(quant.cpu_kernels(), "fp8_matmul")
    _, kept = load_hf_dir(str(path), placement=Placement(torch.bfloat16))
    projections = [name for name in kept if ".layers." in name and name.endswith("_proj.weight")]
    assert projections
    for name in projections:
        assert isinstance(kept[name], quant.QuantizedWeight) and kept[name].is_fp8, name
        assert torch.equal(kept[name].codes.view(torch.uint8), stored[name].view(torch.uint8)), name
    for layer in ours.layers:
        for w in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            assert isinstance(w, quant.QuantLinear) and w.is_fp8 and w.ops is not None and w.fp8 is None

    monkeypatch.setattr(quant, "cpu_kernels", lambda: None)  # a CPU without the kernel: dequantized at load
    _, weights = load_hf_dir(str(path), placement=Placement(torch.bfloat16))
    for name in projections:
        scale = stored[name + "_scale_inv"] if name + "_scale_inv" in stored else stored[name + "_scale"]
        strategy = "block" if scale.dim() == 2 and scale.shape[1] > 1 else "tensor"  # "channel" reads as "tensor"
        want = dequantize(stored[name], scale.float(), strategy).to(torch.bfloat16)
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], want), name
    down = "model.layers.0.mlp.down_proj.weight"
    assert runs_as_fp8(down, False, torch.device("cuda"))
    assert not runs_as_fp8(down, False, torch.device("cpu"), kept[down]) and not runs_as_fp8(down, True,
                                                                                            torch.device("cuda"))
    assert not runs_as_fp8("model.embed_tokens.weight", False, torch.device("cuda"))
    monkeypatch.undo()
    assert runs_as_fp8(down, False, torch.device("cpu"), kept[down], torch.float32)
    assert not runs_as_fp8(down, False, torch.device("cpu"), kept[down], torch.float16)  # not a dtype it takes
    assert not runs_as_fp8(down, True, torch.device("cpu"), kept[down])


def test_logits_and_greedy_tokens_match_the_dequantized_model(pair):
    assert_matches_dequantized(*pair)


@pytest.mark.parametrize("strategy", ["block", "tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_matmul_equals_dequantize_then_matmul(strategy, dtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 320, generator=gen)
    codes, scale = fp8_quantize(w, strategy)
    weight = fp8_weight(codes, scale, "w")
    x = torch.randn(5, 320, generator=gen).to(dtype)
    # the weights exactly (float32 in the kernel's registers), the float32 product rounded once to x's dtype
    want = (x.float() @ dequantize(codes, scale, strategy).T).to(dtype)
    got = quant.QuantLinear(weight, dtype, torch.device("cpu"))(x)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=1e-2 if dtype != torch.float32
                                                 else 1e-5, atol=1e-4)
    assert weight.nbytes < w.numel() * 2  # one byte a value plus the scales


def test_fp8_weights_fuse_across_q_k_v():
    gen = torch.Generator().manual_seed(4)
    parts = [fp8_weight(*fp8_quantize(torch.randn(rows, 256, generator=gen), "block"), "w") for rows in (256, 64, 64)]
    fused = quant.cat_rows(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_the_worker_serves_an_fp8_checkpoint_and_refuses_what_it_does_not_apply(tmp_path):
    """Through the worker's own path (ModelRunner, --quantization fp8 agreeing with the checkpoint): chunked prefills
    beside decodes give each request the FP8 model's greedy tokens alone; a worker given a static activation scheme
    fails at start naming the field, and so does --quantization naming another format. (-O1's refusal of weights
    that stay quantized: test_gptq_model.py; on the CPU -O1 serves an FP8 checkpoint dense: below.)"""
    write_fp8_checkpoint(tmp_path, "fp8_block")
    runner = ModelRunner(parse(WorkerConfig, ["--model", str(tmp_path), "--quantization", "fp8", "--dtype",
                                              "float32", "--num-gpu-blocks-override", "64"]))
    vocab = runner.config.vocab_size
    reqs = [DriverRequest(f"r{i}", p, pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          arrival_step=2 * i) for i, p in enumerate(prompts(vocab, lengths=(30, 17, 9)))]
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

    assert_fails(run_cli("worker", "--port", 0, "--device", "cpu", "--model", str(tmp_path), "--quantization",
                         "compressed-tensors"), "--quantization compressed-tensors does not match", "'fp8'")
    config_path = tmp_path / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["quantization_config"]["activation_scheme"] = "static"
    config_path.write_text(json.dumps(config_json))
    assert_fails(run_cli("worker", "--port", 0, "--device", "cpu", "--model", str(tmp_path)),
                 "quantization_config.activation_scheme='static'")


def test_o1_serves_an_fp8_checkpoint_on_the_cpu_with_the_tokens_of_o0(tmp_path, monkeypatch):
    """-O1 (the compiled forward: inductor traces dense matmuls, not the FP8 kernel) on the CPU dequantizes the FP8
    projections into --dtype at start (hf_quant.dequantize_fp8_in_place) and serves: greedy tokens equal the -O0
    runner's, which keeps them FP8, over staggered arrivals and 3-token chunks."""
    from worker_svc.model.compiled import CompiledForward

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = tmp_path / "ckpt"
    path.mkdir()
    write_fp8_checkpoint(path, "fp8_block")
    outputs = []
    for argv in ([], ["-O1", "--compilation-config", '{"cudagraph_capture_sizes": [4, 8]}']):
        runner = ModelRunner(parse(WorkerConfig, ["--model", str(path), "--dtype", "float32",
                                                  "--num-gpu-blocks-override", "64", *argv]))
        assert isinstance(runner.model, CompiledForward) == bool(argv)
        layer = getattr(runner.model, "model", runner.model).layers[0]
        assert isinstance(layer.down, quant.QuantLinear) != bool(argv)
        reqs = [DriverRequest(f"r{i}", p, pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                              arrival_step=i) for i, p in enumerate(prompts(runner.config.vocab_size, (12, 7, 5)))]
        run_requests(partial(execute_step, runner), reqs, chunk=3, num_blocks=runner.num_blocks,
                     block_size=runner.block_size)
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1] and all(len(o) == 6 for o in outputs[0])
