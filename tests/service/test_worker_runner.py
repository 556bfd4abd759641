"""The worker's runner on the bundled model: greedy parity with Hugging Face in mixed batches,
chunk sizes 1, 7 and 64, shuffled block tables; seeded sampling independent of companions."""

from functools import partial

import pytest
import torch

from protos import worker_pb2 as pb
from tests.support.driver import DriverRequest, run_requests
from tests.support.hf_reference import shared_result
from worker_svc.server import execute_step

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
    "and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat: it was a",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]
NEW_TOKENS = 32


_HF_GREEDY: dict[tuple, list[int]] = {}  # the session's HF model is shared: each reference is computed once


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Hugging Face forward with its own KV cache, argmax each step (no EOS stop)."""
    key = (id(model), tuple(ids), n)
    if key not in _HF_GREEDY:  # the session's model: once per run for every pytest process
        _HF_GREEDY[key] = shared_result(model, "greedy", [list(ids), n], lambda: _hf_greedy(model, ids, n))
    return list(_HF_GREEDY[key])


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.inference_mode():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    return [hf_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompt_ids]


def greedy_params(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def drive(runner, reqs: list[DriverRequest], chunk: int, seed: int = 0) -> None:
    # Step ids must grow across every test (and module) sharing the session's runner.
    run_requests(partial(execute_step, runner), reqs, chunk=chunk, num_blocks=runner.num_blocks,
                 block_size=runner.block_size, seed=seed, first_step_id=runner.batch.last_step_id + 1)
    assert not len(runner.batch.inputs), "finished requests must leave the worker's batch"


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_mixed_batch_greedy_matches_hf(runner, prompt_ids, hf_outputs, chunk):
    reqs = [DriverRequest(f"c{chunk}-{i}", ids, greedy_params(), arrival_step=(i * 3) % 5)
            for i, ids in enumerate(prompt_ids)]
    drive(runner, reqs, chunk, seed=chunk)
    for i, r in enumerate(reqs):
        assert r.output == hf_outputs[i], f"prompt {i} with chunk {chunk}"
        assert r.finish_reason == pb.FINISH_REASON_MAX_TOKENS


def test_each_prompt_alone_matches_hf(runner, prompt_ids, hf_outputs):
    for i, ids in enumerate(prompt_ids):
        r = DriverRequest(f"alone-{i}", ids, greedy_params())
        drive(runner, [r], 64, seed=100 + i)
        assert r.output == hf_outputs[i]


def test_seeded_sampling_ignores_batch_companions(runner, prompt_ids):
    def sampled(seed: int) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)

    alone = DriverRequest("s-alone", prompt_ids[2], sampled(7))
    drive(runner, [alone], 64)
    crowd = [DriverRequest(f"s-crowd-{i}", ids, sampled(1000 + i) if i % 2 else greedy_params(), arrival_step=i)
             for i, ids in enumerate(prompt_ids)]
    same = DriverRequest("s-same", prompt_ids[2], sampled(7), arrival_step=2)
    other = DriverRequest("s-other", prompt_ids[2], sampled(8), arrival_step=1)
    drive(runner, crowd + [same, other], 5, seed=3)
    assert same.output == alone.output
    assert other.output != alone.output


def test_stops_on_eos_and_max_tokens(runner, prompt_ids, hf_outputs):
    # Stop token ids end the request with STOP_TOKEN; max_tokens with MAX_TOKENS.
    target = hf_outputs[0][3]
    r = DriverRequest("stop-tok", prompt_ids[0], greedy_params(stop_token_ids=[target]))
    short = DriverRequest("short", prompt_ids[1], greedy_params())
    short.sampling.max_tokens = 4
    drive(runner, [r, short], 64)
    assert r.output == hf_outputs[0][: hf_outputs[0].index(target) + 1]
    assert r.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert short.output == hf_outputs[1][:4] and short.finish_reason == pb.FINISH_REASON_MAX_TOKENS


def test_logprobs_match_hf(runner, hf_model, prompt_ids):
    r = DriverRequest("lp", prompt_ids[3], pb.SamplingParams(max_tokens=1, logprobs=5))
    drive(runner, [r], 64)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt_ids[3]])).logits[0, -1].float(), -1)
    assert abs(r.logprobs[0] - ref.max().item()) < 1e-3
