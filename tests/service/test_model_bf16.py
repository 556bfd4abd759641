"""bfloat16 parity with Hugging Face transformers in bfloat16, and what `--dtype auto` picks.

The rule for near-ties: in bfloat16 two logits within a couple of rounding steps of each other are a tie that the
order of additions decides, so the two implementations may break it differently. Greedy tokens must be identical up
to the first position where they differ; at that position Hugging Face's logit for our token must be within NEAR_TIE
of its own choice's (an exact bfloat16 tie included: Hugging Face's argmax then takes the lower token id, where our
sums may put the other ahead). Everything after a tie is a different continuation and is not compared.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.e2e.test_startup_validation import assert_fails, run_cli
from tests.service.test_model import PROMPTS, PagedRunner
from worker_svc.core.runner import resolve_dtype
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.layers.linear import cpu_has_native_bf16, cpu_has_native_fp16
from worker_svc.model.loader import load_model_weights

# Two bfloat16 steps at the logits' magnitude (16..32, where one step is 0.125).
NEAR_TIE = 0.25
NUM_NEW = 16


@pytest.fixture(scope="module")
def hf_bf16(hf_model):
    """Hugging Face's model in bfloat16: what `from_pretrained(..., dtype=torch.bfloat16)` gives (the same parameters,
    cast from the float32 dequantized weights; the rotary tables kept in float32), built from the session's float32
    model instead of loading the GGUF a second time (the load is most of this module's time on a CPU)."""
    model = copy.deepcopy(hf_model)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model.eval()


def test_auto_dtype_is_bf16_where_native():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_float16_on_a_cpu_needs_native_float16():
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16
    if cpu_has_native_fp16():
        assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
        return
    with pytest.raises(ValueError, match="--dtype float16 needs a CPU with AVX512-FP16 or AMX-FP16"):
        resolve_dtype("float16", torch.device("cpu"))
    assert_fails(run_cli("worker", "--port", 0, "--device", "cpu", "--dtype", "float16"),
                 "--dtype float16 needs a CPU", "--dtype auto, bfloat16 or float32")


# Heavy: the bundled model's 30 layers in bfloat16 both here and in HF's, emulated by oneDNN without AVX512-BF16 (a
# minute of a --fast run on such a CPU); --fast keeps bfloat16 in the C++ layers' bit-identity (test_cpu_layers.py)
# and the quantized model's bfloat16 check (test_quantized_model.py).
@pytest.mark.heavy
def test_bf16_greedy_matches_hf_bf16_up_to_near_ties(bundled_model_path, hf_tokenizer, hf_bf16):
    config, weights = load_model_weights(bundled_model_path)
    model = LlamaModel(config, weights, torch.bfloat16, "cpu")
    prompts = {i: hf_tokenizer(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    runner = PagedRunner(model, num_blocks=64, seed=5)
    ours: dict[int, list[int]] = {i: [] for i in prompts}
    logits = runner.step(prompts)  # all prompts in one prefill, then batched decodes
    for _ in range(NUM_NEW):
        for sid, tok in zip(prompts, logits.argmax(-1).tolist(), strict=True):
            ours[sid].append(tok)
        logits = runner.step({sid: [ours[sid][-1]] for sid in prompts})

    num_equal = 0
    for sid, ids in prompts.items():
        with torch.no_grad():
            out = hf_bf16.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=NUM_NEW, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        first = next((j for j in range(NUM_NEW) if theirs[j] != ours[sid][j]), None)
        if first is None:
            num_equal += 1
            continue
        hf_logits = out.logits[first][0].float()
        gap = (hf_logits[theirs[first]] - hf_logits[ours[sid][first]]).item()
        assert 0 <= gap <= NEAR_TIE, f"prompt {sid}: token {first} differs where HF's logits are {gap} apart"
    assert num_equal >= len(prompts) // 2, "most prompts meet no near-tie in NUM_NEW tokens"
