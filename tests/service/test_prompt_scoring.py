"""The worker's prompt results on the bundled model in float32: prompt logprobs (each prompt token's log-softmax and
top ones) and pooled embeddings (LAST, MEAN, CLS), against Hugging Face transformers, with the prompt computed in
one chunk or in several, next to a generating request."""

from functools import partial

import numpy as np
import pytest
import torch

from protos import worker_pb2 as pb
from tests.support.driver import DriverRequest, run_requests
from worker_svc.sampling.pooler_config import CLS, LAST, MEAN, PoolerConfig
from worker_svc.sampling.pooling import Pooler
from worker_svc.server import execute_step

PROMPT = ("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of "
          "worms and an oozy smell.")
COMPANION = "The capital of France is"
TOP = 3


@pytest.fixture(scope="module")
def ids(hf_tokenizer) -> list[int]:
    return hf_tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def hf_states(hf_model, ids):
    """Hugging Face's log-softmax over the prompt and its final hidden states (after the last norm)."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1), out.hidden_states[-1][0].float()


def run(runner, sampling: pb.SamplingParams, ids: list[int], chunk: int) -> list[pb.StepResult]:
    """`ids` with `sampling`, next to a plain greedy companion; every step's result."""
    results: list[pb.StepResult] = []
    reqs = [DriverRequest("scored", ids, sampling),
            DriverRequest("companion", runner_ids(runner, COMPANION), pb.SamplingParams(temperature=0, max_tokens=4))]
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, first_step_id=runner.batch.last_step_id + 1, spec_results=results)
    assert not len(runner.batch.inputs)
    return results


def runner_ids(runner, text: str) -> list[int]:
    return [1] + [ord(c) % 1000 + 2 for c in text]  # any tokens will do for the companion


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prompt_logprobs_match_hf(runner, ids, hf_states, chunk):
    results = run(runner, pb.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP), ids, chunk)
    got: dict[int, tuple[float, list[int], list[float]]] = {}
    for r in results:
        at = top_at = 0
        for start, n, k in zip(r.prompt_lp_starts, r.prompt_lp_counts, r.prompt_lp_num_top, strict=True):
            assert k == TOP
            for j in range(n):
                got[start + j] = (r.prompt_lp_values[at + j], list(r.prompt_lp_top_token_ids[top_at: top_at + k]),
                                  list(r.prompt_lp_top_values[top_at: top_at + k]))
                top_at += k
            at += n
        if chunk < len(ids) - 1:
            assert sum(r.prompt_lp_counts) <= chunk, "a step scores only its own chunk's tokens"
    assert sorted(got) == list(range(1, len(ids))), "every prompt token from the second on, once"
    ref, _ = hf_states
    for pos, (value, top_ids, top_values) in got.items():
        assert abs(value - float(ref[pos - 1, ids[pos]])) < 1e-4, pos
        want_values, want_ids = ref[pos - 1].topk(TOP)
        assert np.allclose(top_values, want_values.numpy(), atol=1e-4), pos
        assert top_ids == want_ids.tolist(), pos


@pytest.mark.parametrize("kind,chunk", [(LAST, 64), (LAST, 7), (MEAN, 7), (MEAN, 64), (CLS, 5)])
def test_pooled_embedding_matches_hf(runner, ids, hf_states, kind, chunk):
    saved = runner.pooler
    runner.pooler = Pooler(PoolerConfig(kind, normalize=True))
    try:
        results = run(runner, pb.SamplingParams(temperature=0, max_tokens=1, embed=True), ids, chunk)
    finally:
        runner.pooler = saved
    pooled = [r for r in results if r.pooled_slots]
    assert len(pooled) == 1 and len(pooled[0].pooled_slots) == 1, "one vector, with the step that ends the prompt"
    vector = torch.tensor(list(pooled[0].pooled))
    _, hidden = hf_states
    want = {LAST: hidden[-1], MEAN: hidden.mean(0), CLS: hidden[0]}[kind]
    assert vector.shape == want.shape
    assert abs(float(vector.norm()) - 1.0) < 1e-4, "L2-normalised by default"
    assert float(torch.nn.functional.cosine_similarity(vector, want, dim=0)) >= 0.9999


def test_pooler_config_refuses_bad_json():
    for text, word in [('{"pooling_type": "MAX"}', "pooling_type"), ('{"normalize": 1}', "normalize"),
                       ('{"pooling": "LAST"}', "unknown key 'pooling'"), ("[1]", "JSON object"), ("{", "JSON object")]:
        with pytest.raises(ValueError, match=word):
            PoolerConfig.parse(text)
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(MEAN, False)
