"""The compiled forward (-O1..3) on the families beyond Llama's plain layer: Qwen3's per-head q/k norm, with and
without sliding-window layers, and Mistral's window, each against the eager forward on a transformers-written
random checkpoint (same greedy tokens, logits within tolerance) over chunked prefill past the window mixed with
decodes; and the families whose layers it does not compile (Gemma, the sparse MoE ones) refused naming them."""

from __future__ import annotations

import pytest
import torch

from tests.service.test_model import PagedRunner
from tests.service.test_model_families import make_checkpoint, prompts
from tests.support import moe_checkpoints as mc
from worker_svc.config import CompilationConfig
from worker_svc.model import families as models
from worker_svc.model.compiled import CompiledForward
from worker_svc.model.loader import load_hf_dir

SIZES = (4, 8)
CHUNK = 3  # prompt tokens per sequence and step: two prompts + a decode stay within the largest size


def build(path: str, **kwargs):
    config, weights = load_hf_dir(path)
    return models.by_name(config.architecture)(config, weights, torch.float32, "cpu", **kwargs)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # a fresh cache, and no leftover setting for later tests
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.mark.heavy  # a cold inductor compile: the default run, not --fast
@pytest.mark.parametrize("family", ["qwen3", "qwen3_sliding", "mistral"])
def test_compiled_matches_eager(family, tmp_path, inductor_cache):
    make_checkpoint(family, tmp_path)
    eager = build(str(tmp_path))
    compiled = CompiledForward(build(str(tmp_path), prepack=False), CompilationConfig(cudagraph_capture_sizes=SIZES))
    if family.startswith("qwen3"):
        assert all(layer.qk_norm is not None for layer in compiled.model.layers)
    if family != "qwen3":  # prompts run past the window of (some) layers
        assert any("sliding_window" in kw for kw in compiled.model.attn_kwargs)
    runners = [PagedRunner(eager, num_blocks=64, seed=3), PagedRunner(compiled, num_blocks=64, seed=3)]
    # Two prompts longer than every window, prefilled CHUNK tokens at a time; the first decodes greedily while the
    # second still prefills (mixed steps), then both decode.
    first, second = prompts(eager.config.vocab_size, lengths=(30, 42))
    last: dict[int, int] = {}
    padded, steps = set(), 0
    while steps < 24:
        chunks = {}
        for sid, prompt in enumerate((first, second)):
            done = runners[0].lengths.get(sid, 0)
            chunks[sid] = prompt[done:done + CHUNK] if done < len(prompt) else [last[sid]]
        padded.add(compiled.padded_size(sum(map(len, chunks.values()))))
        want, got = (r.step(chunks) for r in runners)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"{family}: step {steps}"
        last.update(zip(chunks, want.argmax(-1).tolist(), strict=True))
        steps += 1
    assert padded == {4, 8}
    assert max(runners[0].lengths.values()) > 42  # decoded past the prompts


@pytest.mark.parametrize("family", ["gemma2", "gemma3", *mc.FAMILIES])
def test_other_layers_refused_naming_the_architecture(family, tmp_path):
    """Gemma (four norms, GeGLU, scaled embedding) and the sparse MoE families override the decoder layer: -O1+
    refuses them at start by name, -O0 runs them."""
    if family in mc.FAMILIES:
        mc.write_checkpoint(family, str(tmp_path))
    else:
        make_checkpoint(family, tmp_path)
    model = build(str(tmp_path), prepack=False)
    with pytest.raises(ValueError, match=f"Llama-shaped decoder only, not {model.config.architecture}; use -O0"):
        CompiledForward(model, CompilationConfig(cudagraph_capture_sizes=SIZES))
