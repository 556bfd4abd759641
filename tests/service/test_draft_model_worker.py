"""Speculative decoding with a draft model on the worker's runner (bundled model as its own draft, in process):
greedy output equals Hugging Face's and nearly every draft is accepted; seeded sampling repeats and stays the
target's distribution (rejection sampling; the distribution itself is checked in tests/unit/test_rejection_sampler.py
and tests/e2e/test_draft_model.py)."""

from functools import partial

import pytest

from protos import worker_pb2 as pb
from tests.service.test_worker_runner import NEW_TOKENS, PROMPTS, greedy_params, hf_greedy
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.server import execute_step

K = 3


@pytest.fixture(scope="module")
def draft_runner(bundled_model_path):
    spec = f'{{"method": "draft_model", "model": "{bundled_model_path}", "num_speculative_tokens": {K}}}'
    return ModelRunner(WorkerConfig(model=bundled_model_path, dtype="float32", num_gpu_blocks_override=256,
                                    speculative_config=spec))


def drive(runner, reqs: list[DriverRequest], chunk: int, seed: int = 0, drafts: int = K) -> list[pb.StepResult]:
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, seed=seed, first_step_id=runner.batch.last_step_id + 1,
                 num_draft_slots=drafts, spec_results=results)
    assert not len(runner.batch.inputs), "finished requests must leave the worker's batch"
    return results


def counts(results: list[pb.StepResult]) -> tuple[int, int]:
    return (sum(sum(r.spec_num_draft_tokens) for r in results), sum(sum(r.spec_num_accepted_tokens) for r in results))


def test_the_pool_holds_both_models_kv(draft_runner, runner):
    assert draft_runner.draft.kv.shape[2] == draft_runner.num_blocks == draft_runner.kv.shape[2]
    assert draft_runner.kv_bytes_per_block == 2 * runner.kv_bytes_per_block


# Whole prompts (64) are heavy: --fast prefills whole prompts with the draft model in the seeded test below.
@pytest.mark.parametrize("chunk", [5, pytest.param(64, marks=pytest.mark.heavy)], ids=["chunked", "whole"])
def test_greedy_with_its_own_draft_matches_hf_and_accepts_nearly_all(draft_runner, hf_tokenizer, hf_model, chunk):
    prompt_ids = [hf_tokenizer.encode(p) for p in PROMPTS]
    reqs = [DriverRequest(f"draft-c{chunk}-{i}", ids, greedy_params(), arrival_step=(i * 3) % 5)
            for i, ids in enumerate(prompt_ids)]
    drafted, accepted = counts(drive(draft_runner, reqs, chunk, seed=chunk))
    for i, r in enumerate(reqs):
        assert r.output == hf_greedy(hf_model, prompt_ids[i], NEW_TOKENS), f"prompt {i} with chunk {chunk}"
    assert drafted > 50 and accepted > 0.9 * drafted, (drafted, accepted)


def test_seeded_sampling_with_a_draft_model_repeats(draft_runner, hf_tokenizer):
    """Same seeds, different batch companions and chunking: the same text (every draw is keyed by seed and
    position); with its own draft q == p, so every draft is accepted."""
    prompt_ids = [hf_tokenizer.encode(p) for p in PROMPTS]

    def params(i: int) -> pb.SamplingParams:
        p = pb.SamplingParams(temperature=0.8, top_p=0.95, seed=70 + i, max_tokens=16, ignore_eos=True)
        if i % 2:
            p.repetition_penalty, p.logprobs = 1.2, 1
        return p

    first = [DriverRequest(f"s1-{i}", ids, params(i)) for i, ids in enumerate(prompt_ids)]
    drafted, accepted = counts(drive(draft_runner, first, 64))
    again = [DriverRequest(f"s2-{i}", ids, params(i), arrival_step=i) for i, ids in enumerate(prompt_ids)]
    drive(draft_runner, again, 7, seed=3)
    for a, b in zip(first, again, strict=True):
        assert a.output == b.output, a.request_id
    assert drafted > 20 and accepted > 0.9 * drafted, (drafted, accepted)
