"""Speculative decoding units: the --speculative-config parser, the n-gram proposer (against a plain reference), the
acceptance rule, the rejection sampler's distribution, and the scheduler core's token and block accounting with a
stand-in worker that accepts a random number of drafts (pipelined and not, with preemption)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.sampling_fields import SamplingParams
from common.speculative_config import SpeculativeConfig, parse_speculative_config
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.step_records import WORKER_MAX_TOKENS, SampledToken, WorkerOutput
from worker_svc.core.ngram_drafts import accepted_lengths, propose_ngram
from worker_svc.sampling.sampler import SamplingBatch, sample_batch

# ---- the flag -------------------------------------------------------------------------------------------------


def test_config_parses_vllm_keys():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                                   '"prompt_lookup_max": 3}')
    assert cfg == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=3)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config('{"num_speculative_tokens": 2}').prompt_lookup_max == 4
    draft = parse_speculative_config('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/m", 3)
    head = parse_speculative_config('{"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 3}')
    assert (head.method, head.model, head.num_speculative_tokens) == ("eagle3", "/heads/e3", 3)
    assert parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 1}').model is None


@pytest.mark.parametrize(("text", "words"), [
    ("{not json", ["--speculative-config", "JSON"]),
    ('{"method": "eagle", "num_speculative_tokens": 2}', ["method", "eagle", "ngram"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', ["unknown key", "draft_model"]),
    ('{"method": "ngram"}', ["num_speculative_tokens", "required"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', ["'model'", "required"]),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', ["'model'", "absent", "ngram"]),
    ('{"num_speculative_tokens": 0}', ["num_speculative_tokens", ">= 1"]),
    ('{"num_speculative_tokens": 99}', ["num_speculative_tokens", "<= 16"]),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     ["prompt_lookup_min", "prompt_lookup_max"]),
    ('{"num_speculative_tokens": "4"}', ["num_speculative_tokens", "integer"]),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', ["model", "required", "eagle3"]),
    ('{"method": "ngram", "model": "/x", "num_speculative_tokens": 2}', ["model", "ngram"]),
])
def test_config_errors_name_the_flag_and_key(text, words):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(text)
    assert "--speculative-config" in str(e.value)
    for w in words:
        assert w in str(e.value)


# ---- the proposer ---------------------------------------------------------------------------------------------


def reference_proposal(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi .. lo tokens) seen earlier; the tokens after its latest earlier occurrence."""
    L = len(tokens)
    for m in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - m:]
        for end in range(L - 1, m - 1, -1):  # a match ending right before `end` (end <= L - 1)
            if tokens[end - m: end] == suffix:
                return tokens[end: end + k]
    return []


def test_proposer_matches_the_reference_on_random_rows():
    rng = random.Random(5)
    rows = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    rows += [[7], [1, 2], [3, 3, 3, 3], list(range(30))]
    width = max(map(len, rows)) + 8
    tokens = np.full((len(rows), width), 99, dtype=np.int32)  # padding that never matches
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows])
    for k, lo, hi in ((3, 1, 3), (5, 2, 4), (1, 1, 1)):
        caps = np.array([rng.randrange(0, k + 1) for _ in rows])
        drafts, counts = propose_ngram(tokens, lengths, caps, lo, hi)
        for i, r in enumerate(rows):
            want = reference_proposal(r, int(caps[i]), lo, hi)
            assert drafts[i, : counts[i]].tolist() == want, (r, caps[i])


def test_proposer_copies_the_prompt():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 1, 5, 6, 7]  # the output started copying the prompt
    drafts, counts = propose_ngram(np.array([prompt]), np.array([len(prompt)]), np.array([4]), 1, 3)
    assert drafts[0, : counts[0]].tolist() == [8, 9, 10, 11]


def test_accepted_lengths_is_the_leading_agreeing_run():
    targets = np.array([[4, 5, 9, 1], [7, 1, 1, 1], [2, 3, 4, 5], [1, 0, 0, 0]])
    drafts = np.array([[4, 5, 1], [8, 7, 0], [2, 3, 4], [0, 0, 0]])
    counts = np.array([3, 2, 2, 0])
    assert accepted_lengths(targets, drafts, counts).tolist() == [2, 0, 2, 0]


# ---- rejection sampling ---------------------------------------------------------------------------------------


def _batch(n: int, seed: int, vocab: int) -> SamplingBatch:
    f = np.float32
    return SamplingBatch(
        temperature=np.full(n, 1.0, f), top_k=np.zeros(n, np.int64), top_p=np.ones(n, f), min_p=np.zeros(n, f),
        repetition_penalty=np.ones(n, f), presence_penalty=np.zeros(n, f), frequency_penalty=np.zeros(n, f),
        seed=np.full(n, seed, np.uint64), position=np.arange(n, dtype=np.int64) + 10,
        num_output=np.ones(n, np.int64), min_tokens=np.zeros(n, np.int64), ignore_eos=np.zeros(n, bool),
        logprobs=np.full(n, -1, np.int64), stop_token_ids=np.full((n, 1), -1), eos_token_ids=np.full((n, 1), -1))


def test_rejection_sampling_keeps_the_target_distribution():
    """Point-mass draft x: accepted with probability p(x); on rejection the token follows p without x,
    renormalized; overall the emitted token follows p. 40,000 draws, fixed seed; tolerance 0.012 absolute per
    frequency (about 5 standard errors at this N)."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n, x, tol = 40_000, 1, 0.012
    logits = torch.log(p).expand(n, -1).clone()
    # Verification samples the target at the draft's position with that position's noise, as plain sampling does.
    target = sample_batch(logits.clone(), _batch(n, 1234, len(p))).token_ids
    accept = accepted_lengths(np.stack([target, target], 1), np.full((n, 1), x), np.ones(n, np.int64)) == 1
    assert abs(accept.mean() - p[x].item()) < tol
    rejected = target[~accept]
    residual = p.clone()
    residual[x] = 0
    residual /= residual.sum()
    freq = np.bincount(rejected, minlength=len(p)) / len(rejected)
    assert np.abs(freq - residual.numpy()).max() < tol
    # The emitted token (the accepted draft, else the residual draw) against plain sampling with other seeds.
    plain = sample_batch(logits.clone(), _batch(n, 999, len(p))).token_ids
    emitted = np.where(accept, x, target)
    assert np.abs(np.bincount(emitted, minlength=len(p)) / n - np.bincount(plain, minlength=len(p)) / n).max() < tol
    assert np.abs(np.bincount(plain, minlength=len(p)) / n - p.numpy()).max() < tol


# ---- scheduler accounting -------------------------------------------------------------------------------------


class FakeWorker:
    """Holds each request's tokens and computed count as the worker would, places a decode after the drafts it
    accepted before (which the scheduler may not know yet), accepts a random number of granted drafts, and checks
    every step stays inside the blocks the plan gave."""

    def __init__(self, block_size: int, seed: int):
        self.bs, self.rng = block_size, random.Random(seed)
        self.state: dict[str, list] = {}  # rid -> [tokens, computed, max_tokens, prompt_len]
        self.finished: set[str] = set()

    def run(self, out, core: SchedulerCore) -> WorkerOutput:
        for req in out.preempted:
            self.state.pop(req.request_id, None)
        tokens = []
        for req in out.scheduled:
            rid, n = req.request_id, out.num_tokens[req.request_id]
            if rid in self.finished:
                continue  # planned before the scheduler knew (pipelined): the worker skips it
            if rid not in self.state:
                self.state[rid] = [req.prompt_ids + req.output_ids, out.num_computed_before[rid], req.max_tokens,
                                   req.num_prompt_tokens]
            st = self.state[rid]
            toks, computed = st[0], st[1]
            assert computed + n <= len(toks)
            k = out.num_draft_slots.get(rid, 0)
            end = computed + n
            if end < len(toks):
                st[1] = end
                continue
            left = st[2] - (len(toks) - st[3])
            used = min(k, left - 1)
            acc = self.rng.randint(0, max(0, used))
            assert end + used <= len(req.block_ids) * self.bs, "draft positions outside the request's blocks"
            for _ in range(acc + 1):
                tok = (hash((rid, len(toks))) % 50) + 1
                toks.append(tok)
                done = len(toks) - st[3] >= st[2]
                tokens.append(SampledToken(rid, tok, WORKER_MAX_TOKENS if done else None))
                if done:
                    self.finished.add(rid)
                    del self.state[rid]
                    break
            else:
                st[1] = end + acc
        return WorkerOutput(tokens)


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("num_blocks", [12, 200])
def test_core_accounting_with_drafts(pipelined, num_blocks):
    bs = 4
    policy = PolicyConfig(max_num_batched_tokens=24, max_num_seqs=8, block_size=bs, enable_prefix_caching=True,
                          speculative=SpeculativeConfig(num_speculative_tokens=3))
    core = SchedulerCore(policy, BlockPool(num_blocks))
    rng = random.Random(num_blocks)
    reqs = []
    for i in range(10):
        r = Request(f"r{i}", [rng.randrange(1, 9) for _ in range(rng.randrange(2, 14))],
                    SamplingParams(max_tokens=rng.randrange(1, 15)))
        reqs.append(r)
        core.add([r])
    worker = FakeWorker(bs, num_blocks)
    in_flight = None
    drafts = 0
    for _ in range(2000):
        if not core.has_work and in_flight is None:
            break
        out = core.schedule(0.0) if core.has_work else None
        if out is not None and not out.scheduled:
            out = None
        drafts += sum(out.num_draft_slots.values()) if out else 0
        result = worker.run(out, core) if out is not None else None
        if pipelined:
            done, in_flight = in_flight, (out, result) if out is not None else None
        else:
            done = (out, result) if out is not None else None
        if done is not None:
            core.update_from_output(done[0], done[1], 0.0)
        core.take_commit(0)
        core.check_invariant()
    assert not core.has_work and in_flight is None
    for r in reqs:
        assert len(r.output_ids) == r.max_tokens and r.finished and not r.block_ids
    assert drafts > 0
    core.pool.check([])
    assert core.pool.num_free == num_blocks


# ---- metrics and diagnose -------------------------------------------------------------------------------------


def test_spec_metrics_use_vllm_names():
    from prometheus_client import generate_latest

    from scheduler_svc.driver.worker_client import spec_stats
    from scheduler_svc.metrics import Metrics

    m = Metrics("m")
    m.spec_decode(spec_stats([3, 2, 4], [3, 0, 1]))
    text = generate_latest(m.registry).decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'):
        assert line in text


def test_diagnose_flags_speculation_that_costs_more_than_it_gains():
    from llmserve.diagnose import diagnose
    from llmserve.observation import Observation

    def obs(running, accepted):
        return Observation(source="x", running=running, waiting=0, kv_usage=0.3, steps=100,
                           config={"max_num_batched_tokens": 512, "num_speculative_tokens": 4},
                           spec_drafts=100, spec_draft_tokens=400, spec_accepted_tokens=accepted)

    busy_low = diagnose(obs(32, 40))
    assert busy_low.limiter == "speculative-decoding"
    assert "10% of 400 draft tokens accepted" in busy_low.evidence[0]
    assert busy_low.suggestions[0].flag == "--speculative-config"
    assert diagnose(obs(1, 40)).limiter == "none"  # at batch 1 the draft rows are nearly free
    good = diagnose(obs(32, 300))
    assert good.limiter == "none"
    assert any("75% of 400 draft tokens accepted, 3.00 accepted per draft run" in n for n in good.numbers)


def test_diagnose_weighs_accepted_tokens_against_the_step_time_increase_at_the_load():
    from llmserve.diagnose import diagnose, spec_speedup
    from llmserve.observation import Observation

    def obs(running):  # 2 of 4 drafts accepted per run: 3 tokens per request-step for 5 query rows
        return Observation(source="x", running=running, waiting=0, kv_usage=0.3, steps=100,
                           config={"num_speculative_tokens": 4}, spec_drafts=100, spec_draft_tokens=400,
                           spec_accepted_tokens=200)

    assert spec_speedup(obs(64))[0] == pytest.approx(3 / 5)  # compute-bound: every draft row costs a token
    assert spec_speedup(obs(4))[0] == pytest.approx(3 / (1 + 4 * 4 / 64))
    busy = diagnose(obs(64))
    assert busy.limiter == "speculative-decoding" and "about 0.60x" in busy.evidence[0]
    assert diagnose(obs(4)).limiter == "none"
    assert any("speculation estimate at this load: 2.40x" in n for n in diagnose(obs(4)).numbers)
