"""End to end: the worker runner with `--attention-backend triton` (Triton interpreter on CPU) against the
torch backend on a 2-layer random-weight Llama: same greedy tokens, logits within 1e-3, step by step,
through staggered arrivals, chunked prefill and mixed prefill+decode batches."""

from __future__ import annotations

import argparse
import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    # Before kernels.triton_attention is imported, and for the session: see tests/e2e/test_triton_attention.py.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402
import triton  # noqa: E402, F401

import kernels  # noqa: E402
from protos import worker_pb2 as pb  # noqa: E402
from tests.support.driver import DriverRequest, run_requests  # noqa: E402
from worker_svc.core.runner import ModelRunner, resolve_attention_backend  # noqa: E402
from worker_svc.server import add_worker_args, config_from_args, execute_step  # noqa: E402

if not torch.cuda.is_available() and not kernels.get_backend("triton").INTERPRET:
    raise RuntimeError("kernels.triton_attention was imported without TRITON_INTERPRET=1 and there is no GPU "
                       "(tests/conftest.py sets it before any import)")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=384, intermediate_size=512, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF init leaves norms at 1: randomise everything
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=gen) if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("llama2l")
    model.eval().save_pretrained(path, safe_serialization=True)
    return str(path)


def make_runner(model_dir: str, backend: str) -> ModelRunner:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    args = parser.parse_args(["--model", model_dir, "--device", "cpu", "--dtype", "float32", "--block-size", "16",
                              "--num-gpu-blocks-override", "48", "--attention-backend", backend])
    runner = ModelRunner(config_from_args(args))
    logits: list[torch.Tensor] = []
    forward = runner.model.forward

    def recording_forward(*a, **kw):
        out = forward(*a, **kw)
        logits.append(out.detach().clone())
        return out

    runner.model.forward = recording_forward
    runner.recorded_logits = logits
    return runner


def drive(runner: ModelRunner, seed: int) -> list[DriverRequest]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [37, 5, 20, 16, 1, 50]
    reqs = [DriverRequest(f"r{i}", torch.randint(3, 512, (n,), generator=gen).tolist(),
                          pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          arrival_step=(2 * i) % 5)
            for i, n in enumerate(lengths)]
    run_requests(partial(execute_step, runner), reqs, chunk=9, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, seed=seed)
    return reqs


def test_triton_backend_matches_torch_backend(model_dir):
    torch_runner = make_runner(model_dir, "torch")
    triton_runner = make_runner(model_dir, "triton")
    assert torch_runner.attention_backend == "torch"
    assert triton_runner.attention_backend == "triton"
    assert triton_runner.model.attention is kernels.get_backend("triton")

    expected = drive(torch_runner, seed=1)
    got = drive(triton_runner, seed=1)
    for e, g in zip(expected, got, strict=True):
        assert len(g.output) == NEW_TOKENS
        assert g.output == e.output, f"{g.request_id}: greedy tokens differ"
    ref_logits, tri_logits = torch_runner.recorded_logits, triton_runner.recorded_logits
    assert len(tri_logits) == len(ref_logits) > NEW_TOKENS
    for step, (a, b) in enumerate(zip(ref_logits, tri_logits, strict=True)):
        assert a.shape == b.shape
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        assert diff < 1e-3, f"step {step}: max abs logit diff {diff}"


def test_auto_backend_is_torch_on_cpu_and_flag_is_validated():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="attention-backend"):
        resolve_attention_backend("flash", torch.device("cpu"))
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    assert parser.parse_args([]).attention_backend == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "cuda"])
