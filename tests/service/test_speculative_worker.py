"""Speculative decoding on the worker's runner (bundled model, in process): drafts verified as extra query rows give
the tokens plain decoding gives (greedy: Hugging Face's), seeded sampling included, and a stop token or max_tokens
inside an accepted run ends the request at that token."""

from functools import partial

import pytest

from protos import worker_pb2 as pb
from tests.service.test_worker_runner import NEW_TOKENS, PROMPTS, greedy_params, hf_greedy
from tests.support.driver import DriverRequest, run_requests
from worker_svc.server import execute_step

K = 4


def drive(runner, reqs: list[DriverRequest], chunk: int, seed: int = 0, drafts: int = K) -> list[pb.StepResult]:
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, seed=seed, first_step_id=runner.batch.last_step_id + 1,
                 num_draft_slots=drafts, spec_results=results)
    assert not len(runner.batch.inputs), "finished requests must leave the worker's batch"
    return results


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    return [hf_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompt_ids]


def accepted(results: list[pb.StepResult]) -> int:
    return sum(sum(r.spec_num_accepted_tokens) for r in results)


# Whole prompts (64) are heavy: --fast prefills a whole prompt with drafts, held to HF's tokens, in
# test_stop_token_and_max_tokens_inside_an_accepted_run.
@pytest.mark.parametrize("chunk", [7, pytest.param(64, marks=pytest.mark.heavy)], ids=["chunked", "whole"])
def test_greedy_with_drafts_matches_hf_in_mixed_batches(runner, prompt_ids, hf_outputs, chunk):
    reqs = [DriverRequest(f"spec-c{chunk}-{i}", ids, greedy_params(), arrival_step=(i * 3) % 5)
            for i, ids in enumerate(prompt_ids)]
    results = drive(runner, reqs, chunk, seed=chunk)
    for i, r in enumerate(reqs):
        assert r.output == hf_outputs[i], f"prompt {i} with chunk {chunk}"
        assert r.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert accepted(results) > 10, "the workload was meant to accept drafts"


def test_seeded_sampling_with_drafts_equals_plain_sampling(runner, prompt_ids):
    """Rejection sampling with the position's own noise: token for token the text plain sampling gives, with
    top-p, penalties and logprobs in the batch."""
    def params(i: int) -> pb.SamplingParams:
        p = pb.SamplingParams(temperature=0.7, top_p=0.95, seed=50 + i, max_tokens=24, ignore_eos=True)
        if i % 3 == 1:
            p.repetition_penalty, p.logprobs = 1.1, 2
        return p

    def run(drafts: int) -> tuple[list[DriverRequest], list[pb.StepResult]]:
        reqs = [DriverRequest(f"sampled-{drafts}-{i}", ids, params(i), arrival_step=i % 3)
                for i, ids in enumerate(prompt_ids)]
        return reqs, drive(runner, reqs, 16, drafts=drafts)

    plain, _ = run(0)
    spec, results = run(K)
    for a, b in zip(plain, spec, strict=True):
        assert a.output == b.output, a.request_id
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) if a.sampling.HasField("logprobs") else True
    assert sum(sum(r.spec_num_draft_tokens) for r in results) > 0


def _mid_run_positions(results: list[pb.StepResult], slot_tokens: int = 3) -> list[int]:
    """Output indexes of tokens that came as the 2nd.. of a request's tokens in one step (inside accepted runs),
    for the first request of the step results (all single-request runs here)."""
    out, at = [], 0
    for r in results:
        n = len(r.token_ids)
        out += [at + j for j in range(1, n)]
        at += n
    return out


def test_stop_token_and_max_tokens_inside_an_accepted_run(runner, prompt_ids, hf_outputs):
    i = 3  # "1, 2, 3, 4, 5," continues by counting: long accepted runs
    ref = DriverRequest("run-ref", prompt_ids[i], greedy_params())
    results = drive(runner, [ref], 64)
    assert ref.output == hf_outputs[i]
    inside = [p for p in _mid_run_positions(results) if ref.output.index(ref.output[p]) == p]
    assert inside, "no token inside an accepted run to stop at"
    pos = inside[len(inside) // 2]
    stop = DriverRequest("run-stop", prompt_ids[i], greedy_params(stop_token_ids=[ref.output[pos]]))
    drive(runner, [stop], 64)
    assert stop.output == ref.output[: pos + 1] and stop.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    cut = max(_mid_run_positions(results))
    short = DriverRequest("run-len", prompt_ids[i], greedy_params())
    short.sampling.max_tokens = cut  # ends inside what was an accepted run (the worker trims the drafts to fit)
    drive(runner, [short], 64)
    assert short.output == ref.output[:cut] and short.finish_reason == pb.FINISH_REASON_MAX_TOKENS


def test_eos_with_drafts_ends_the_request(runner, prompt_ids, hf_outputs):
    eos = set(runner.config.eos_token_ids)
    i = 0  # "The capital of France is": the model ends its answer within NEW_TOKENS
    end = next(j for j, t in enumerate(hf_outputs[i]) if t in eos)
    r = DriverRequest("spec-eos", prompt_ids[i], pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    drive(runner, [r], 64)
    assert r.output == hf_outputs[i][: end + 1] and r.finish_reason == pb.FINISH_REASON_EOS
