"""logit_bias (OpenAI: added to the logits before sampling) and bad_words (vLLM: a word's last token is banned where
the output ends with its other tokens) in the batched sampler, per row and through the persistent batch's arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.sampling_fields import SamplingParams
from protos import worker_pb2 as pb
from tests.support.legacy_host_path import SampleRow
from tests.unit.test_sampler_batched import sample
from worker_svc.core.persistent_batch import BatchLimits, PersistentBatch
from worker_svc.sampling.sampler import sample_batch
from worker_svc.wire import sampling_to_wire, step_plan

V = 32
EOS = frozenset({0})


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, seed=1, **kw)


def row(p: SamplingParams, output=(), prompt=(1, 2, 3)) -> SampleRow:
    return SampleRow(p, list(prompt), list(output), len(prompt) + len(output), EOS)


def test_logit_bias_forces_and_bans_a_greedy_token():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    top = int(logits.argmax())
    other = (top + 5) % V
    assert sample(logits.clone(), [row(greedy(logit_bias={other: 100.0}))]).token_ids == [other]
    banned = sample(logits.clone(), [row(greedy(logit_bias={top: -100.0}))]).token_ids[0]
    assert banned != top and banned == int(logits[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    # The logprobs stay those of the raw distribution (as for penalties).
    out = sample(logits.clone(), [row(greedy(logit_bias={other: 100.0}, logprobs=0))])
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[other].item())


def test_bad_words_mask_the_last_token_only_after_the_rest():
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0  # greedy picks 9 unless it is banned
    logits[0, 4] = 1.0
    word = greedy(bad_words=[[7, 8, 9]])
    assert sample(logits.clone(), [row(word, output=[7, 8])]).token_ids == [4]  # the output ends with 7 8
    assert sample(logits.clone(), [row(word, output=[8, 7])]).token_ids == [9]
    assert sample(logits.clone(), [row(word, output=[8])]).token_ids == [9]  # too short
    # Prompt tokens are not output: a prompt ending 7 8 bans nothing.
    assert sample(logits.clone(), [row(word, prompt=[1, 7, 8])]).token_ids == [9]
    assert sample(logits.clone(), [row(greedy(bad_words=[[9]]))]).token_ids == [4]  # one token: always
    both = greedy(bad_words=[[9], [2, 4]])
    assert sample(logits.clone(), [row(both, output=[2])]).token_ids[0] not in (9, 4)


def random_params(rng: random.Random) -> SamplingParams:
    bias = {t: rng.choice([-100.0, -3.5, 2.0, 100.0]) for t in rng.sample(range(V), rng.choice([0, 0, 1, 4]))}
    words = [[rng.randrange(V) for _ in range(rng.randint(1, 4))] for _ in range(rng.choice([0, 0, 1, 3]))]
    return SamplingParams(temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randrange(1 << 63),
                          logit_bias=bias, bad_words=words, repetition_penalty=rng.choice([1.0, 1.2]))


def reference(logits: torch.Tensor, r: SampleRow) -> torch.Tensor:
    """What the two fields do to one row's logits, written plainly."""
    x = logits.clone()
    for t, b in r.params.logit_bias.items():
        x[t] += b
    out = r.output_ids
    for w in r.params.bad_words:
        if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = float("-inf")
    return x


@pytest.mark.parametrize("seed", range(12))
def test_through_the_persistent_batch_equals_the_plain_reference(seed):
    """Rows with and without either field in one batch, from plans, sampled from the batch's arrays: each row's
    token is the one the plainly biased and masked logits give."""
    rng = random.Random(seed)
    n = rng.choice([1, 3, 9])
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3
    rows = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
        p = random_params(rng)
        if output and rng.random() < 0.5:  # a word the output is in the middle of, ending in the favourite
            p.bad_words.append(output[-rng.randint(1, min(3, len(output))):] + [int(logits[i].argmax())])
        rows.append(row(p, output, prompt))
    batch = PersistentBatch(BatchLimits(num_blocks=1000, block_size=4, max_model_len=64, vocab_size=V))
    plan = pb.StepPlan(step_id=1)
    for i, r in enumerate(rows):
        plan.resumed_requests.add(slot=i, request_id=f"r{i}", token_ids=r.prompt_ids + r.output_ids,
                                  num_prompt_tokens=len(r.prompt_ids), sampling=sampling_to_wire(r.params),
                                  block_ids=range(i * 10, i * 10 + 10))
    p = step_plan(plan)
    batch.apply_plan(p, batch.check_plan(p, "e"))
    order = np.array([batch.inputs.row_of[f"r{i}"] for i in range(len(rows))], dtype=np.int64)
    got = sample_batch(logits.clone(), batch.inputs.sampling_batch(order, np.array(sorted(EOS)))).token_ids.tolist()
    plain_rows = [SampleRow(SamplingParams(**{**r.params.to_dict(), "logit_bias": {}, "bad_words": []}),
                            r.prompt_ids, r.output_ids, r.position, EOS) for r in rows]
    want = sample(torch.stack([reference(logits[i], r) for i, r in enumerate(rows)]), plain_rows).token_ids
    assert got == want
    assert got == sample(logits.clone(), rows).token_ids  # rows packed one by one give the same


def test_rows_without_them_carry_nothing():
    batch = PersistentBatch(BatchLimits(num_blocks=100, block_size=4, max_model_len=64, vocab_size=V))
    plan = pb.StepPlan(step_id=1)
    for i, p in enumerate([greedy(), greedy(logit_bias={3: 1.0}), greedy(bad_words=[[4, 5]])]):
        plan.new_requests.add(slot=i, request_id=f"r{i}", prompt_token_ids=[1, 2], sampling=sampling_to_wire(p),
                              block_ids=[i], num_scheduled_tokens=2)
    plan = step_plan(plan)
    batch.apply_plan(plan, batch.check_plan(plan, "e"))
    inputs = batch.inputs
    assert inputs.plain[:3].tolist() == [True, False, False]  # only the first is a bare argmax
    b = inputs.sampling_batch(np.array([0]), np.array([0]))
    assert b.bias_rows is None and b.bad_words_rows is None
    b = inputs.sampling_batch(np.array([0, 1, 2]), np.array([0]))
    assert b.bias_rows.tolist() == [1] and b.bad_words_rows.tolist() == [2]


def test_the_worker_refuses_token_ids_outside_the_vocabulary():
    batch = PersistentBatch(BatchLimits(num_blocks=100, block_size=4, max_model_len=64, vocab_size=V))
    for p in (pb.SamplingParams(logit_bias={V: 1.0}), pb.SamplingParams(bad_words=[pb.TokenIds(ids=[1, V])])):
        plan = pb.StepPlan(step_id=1)
        plan.new_requests.add(slot=0, request_id="r", prompt_token_ids=[1], sampling=p, block_ids=[0],
                              num_scheduled_tokens=1)
        with pytest.raises(Exception, match=f"token id {V} is outside the vocabulary"):
            batch.check_plan(step_plan(plan), "e")
