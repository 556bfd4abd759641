"""The decoder layers in one C++ call (worker_svc/cpu/layer_loop.py, kernels/csrc/decoder_layers.cpp) against the Python
layer loop on the bundled model's first layers: the same logits bit for bit over prefill chunks, decodes and mixed
steps, dense float32 and bfloat16 and quantized (GGUF with float and int8 activations, and FP8 block-scaled, float32
and bfloat16); steps the decode
kernel does not wholly serve, LoRA steps and models the loop does not cover keep the Python loop (the model's own
forward, which the loop falls back to)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.service.test_model import PagedRunner
from worker_svc.cpu import layer_loop
from worker_svc.cpu.panel_linear import PanelLinear
from worker_svc.model import quant
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.layers.linear import panels_available
from worker_svc.model.loader import default_model_path, load_model_weights

# (chunks per step): short prefill chunks, decodes of three sequences, a mixed step; then one chunk long enough
# (past the decode kernel's 256-position limit for prefill rows) that attention needs SDPA: the Python loop.
SCRIPT = [
    {0: list(range(5, 60)), 1: list(range(100, 110)), 2: [3]},
    *({0: [7 + i], 1: [9 + i], 2: [11 + i]} for i in range(6)),
    {0: [1], 1: list(range(30, 50))},
    {2: list(range(200, 500))},
    {0: [2], 1: [4], 2: [6]},
]
PYTHON_STEPS = [8]  # the step indices whose attention is not all kernel rows
# Bit for bit holds layer by layer (each layer's output is the next one's input), so depth past a few layers adds
# time, not cases: the bundled model's first 3 layers with its embedding, final norm and head. All 30 layers through
# the C++ loop are held to Hugging Face's greedy tokens by tests/service/test_model.py and test_worker_runner.py.
NUM_LAYERS = 3


@functools.cache
def first_layers(quantization: str | None) -> tuple:
    """The bundled model's config and weights cut to its first NUM_LAYERS decoder layers (loaded once)."""
    config, weights = load_model_weights(default_model_path(), quantization=quantization)
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < NUM_LAYERS}
    layer_types = config.layer_types[:NUM_LAYERS] if config.layer_types else None
    return dataclasses.replace(config, num_layers=NUM_LAYERS, layer_types=layer_types), kept


def run(model: LlamaModel, loop: layer_loop.LayerLoop | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Every step's logits through `loop` (None: the model alone), and the steps that ran the Python layer loop."""
    python_steps, step = [], [0]
    forward = model.forward

    def counted(*args):
        python_steps.append(step[0])
        return forward(*args)

    model.forward = counted
    try:
        runner = PagedRunner(loop or model, 64)
        out = []
        for chunks in SCRIPT:
            out.append(runner.step(chunks))
            step[0] += 1
        return out, python_steps
    finally:
        del model.forward


def fp8_layers() -> tuple:
    """first_layers' projections made FP8 with 128 x 128 block scales (an HF FP8 checkpoint's, hf_quant.py)."""
    from tests.service.test_fp8_model import fp8_quantize
    from worker_svc.model.hf_quant import fp8_weight, packed_by_the_model

    config, weights = first_layers(None)
    return config, {k: fp8_weight(*fp8_quantize(w, "block"), k) if packed_by_the_model(k) else w
                    for k, w in weights.items()}


@pytest.fixture(scope="module", params=["dense", "quantized", "int8-activations", "fp8", "dense-bfloat16",
                                        "quantized-bfloat16", "int8-activations-bfloat16", "fp8-bfloat16"])
def model(request) -> LlamaModel:
    # bfloat16 dense weights are oneDNN's packed copies on a CPU with native bfloat16, plain tensors elsewhere
    kind = request.param.removesuffix("-bfloat16")
    quantization = None if kind == "dense" else "gguf"
    config, weights = fp8_layers() if kind == "fp8" else first_layers(quantization)
    if kind == "int8-activations":
        weights = quant.with_integer_activations(weights, 8, torch.device("cpu"))
    return LlamaModel(config, weights, torch.bfloat16 if request.param.endswith("bfloat16") else torch.float32, "cpu")


def test_cpu_layers_equal_the_python_loop_bit_for_bit(model):
    loop = layer_loop.build(model)
    assert loop is not None  # on the project's kernels: the C++ loop is built
    fused, python_steps = run(model, loop)
    assert python_steps == PYTHON_STEPS
    plain, python_steps = run(model)
    assert python_steps == list(range(len(SCRIPT)))
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item()}"


def test_bfloat16_panels_run_gate_up_and_silu_as_one_matmul():
    """With bfloat16 panels (AVX-512) gate's and up's panels are interleaved in one tensor, the C++ loop's fused
    silu(gate) * up matmul (kernels/csrc/dense_matmul.cpp's dense_swiglu), which the test above holds to the Python
    loop's two matmuls and silu_mul_ bit for bit; the Python loop's gate and up are every other panel of it."""
    if not panels_available(torch.bfloat16):
        pytest.skip("bfloat16 panels need an AVX-512 CPU")
    config, weights = first_layers(None)
    model = LlamaModel(config, weights, torch.bfloat16, "cpu")
    assert layer_loop.build(model) is not None
    layer = model.layers[0]
    gate, up = layer.gate, layer.up
    assert isinstance(gate, PanelLinear) and isinstance(up, PanelLinear)
    panel = gate.panels[0].numel()
    assert gate.panels.stride(0) == up.panels.stride(0) == 2 * panel
    assert up.panels.data_ptr() - gate.panels.data_ptr() == panel * gate.panels.element_size()


class NoLora:
    """A LoRA pool with no adapter loaded (adds nothing): only whether the step takes the Python loop matters."""

    def add(self, layer, group, x, out) -> None:
        pass


# The step takes the Python loop when a LoRA pool is set, whatever the weights and dtype (the runner decides before
# any layer runs, worker_svc/core/runner.py).
def test_a_lora_step_keeps_the_python_loop(model):
    model.lora = NoLora()
    try:
        _, python_steps = run(model, layer_loop.build(model))
    finally:
        model.lora = None
    assert python_steps == list(range(len(SCRIPT)))


def test_models_the_loop_does_not_cover_keep_the_python_loop():
    config, weights = first_layers(None)
    assert layer_loop.build(LlamaModel(config, weights, torch.float16, "cpu")) is None  # float32 and bfloat16 only
    biased = weights | {f"model.layers.{i}.self_attn.{x}_proj.bias": torch.zeros(n)
                        for i in range(config.num_layers)
                        for x, n in (("q", config.num_heads * config.head_dim),
                                     ("k", config.num_kv_heads * config.head_dim),
                                     ("v", config.num_kv_heads * config.head_dim))}
    assert layer_loop.build(LlamaModel(config, biased, torch.float32, "cpu")) is None  # Qwen2's attention biases
    windowed = dataclasses.replace(config, layer_types=["sliding_attention"] * config.num_layers, sliding_window=64)
    assert layer_loop.build(LlamaModel(windowed, weights, torch.float32, "cpu")) is None  # Mistral's sliding window
    assert layer_loop.build(LlamaModel(config, weights, torch.float32, "cpu", prepack=False)) is None  # F.linear
