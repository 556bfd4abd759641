"""Speculative decoding on a hybrid model (Qwen3.5 and Nemotron-H, random-weight checkpoints transformers wrote here),
served by a real worker, scheduler and redis-server: greedy tokens with `--speculative-config` equal transformers'
(and so the run without it) while drafts are both accepted and rejected, so every rejected draft was rolled back out
of the recurrent state (worker_svc/core/draft_rollback.py); pipelined and not, with a few state slots and an
`n = 2` request among repetitive and plain prompts, and with prefix caching by snapshots on; on one and on two
tensor-parallel ranks. The same with an attention-only draft model (method draft_model) of the same vocabulary,
whose drafts the target rejects. Seeded sampled requests with n-gram drafts give the tokens of the same requests
without speculation (the contract of speculation.verifying_draw for point-mass drafts).
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_hybrid_serving import reference, token_prompt
from tests.support import cluster
from tests.support.concurrent_serving import serve_concurrently

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
TIMEOUT_S = 600
POOL = ["--num-gpu-blocks-override", 48, "--max-model-len", 256, "--allow-kv-pool-below-max-model-len",
        "--num-state-slots", 6]
DRAFT = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             num_hidden_layers=1, max_position_embeddings=512)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def hybrid(request, tmp_path_factory):
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_hybrid_families import make_checkpoint

    path = tmp_path_factory.mktemp(f"{request.param}-spec")
    hf = make_checkpoint(request.param, path)
    word_tokenizer(path, hf.config.vocab_size)
    worker = cluster.start_worker(["--model", str(path), *POOL])
    try:
        yield hf, path, worker
    finally:
        cluster.stop(worker)


def cases() -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, n): prompts that repeat a pattern (the lookup proposes drafts the model may or may not
    follow), and plain ones."""
    loops = [(token_prompt(k, 500 + k) * 8)[:40] for k in (3, 5, 7)]
    return [(loops[0], 24, 1), (loops[1], 24, 2), (loops[2], 20, 1), (token_prompt(30, 600), 16, 1),
            (token_prompt(19, 601), 20, 1)]


@pytest.mark.parametrize("flags", [[], ["--no-async-scheduling"]], ids=["pipelined", "not-pipelined"])
def test_speculation_on_a_hybrid_equals_transformers(redis_server, hybrid, flags):
    hf, _, worker = hybrid
    serve_and_compare(redis_server, hf, worker, [*flags, "--speculative-config", SPEC])


def test_speculation_on_two_ranks_equals_transformers(redis_server, hybrid):
    """Tensor parallel 2: the hold and the roll-back reach both ranks' shards of the state pool."""
    hf, path, _ = hybrid
    worker = cluster.start_worker(["--model", str(path), *POOL, "--tensor-parallel-size", 2], timeout=TIMEOUT_S)
    try:
        serve_and_compare(redis_server, hf, worker, ["--speculative-config", SPEC])
    finally:
        cluster.stop(worker)


def test_a_draft_model_on_a_hybrid_equals_transformers(redis_server, hybrid, tmp_path):
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_model_families import make_checkpoint

    hf, path, _ = hybrid
    draft = make_checkpoint("llama", tmp_path, **DRAFT)
    word_tokenizer(tmp_path, draft.config.vocab_size)
    spec = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    worker = cluster.start_worker(["--model", str(path), *POOL, "--speculative-config", spec])
    try:
        # A random draft beside a random target: its drafts are all rejected, each step rolls its state back.
        serve_and_compare(redis_server, hf, worker, ["--speculative-config", spec], min_accepted=0)
    finally:
        cluster.stop(worker)


SAMPLED = [dict(temperature=0.5, seed=11), dict(temperature=0.8, top_p=0.9, seed=5, n=2),
           dict(temperature=0.3, top_k=8, seed=7)]


def test_seeded_sampling_with_ngram_on_a_hybrid_equals_no_speculation(redis_server, hybrid):
    """A seeded sampled request draws each token from the target's distribution with its own generator, and an
    n-gram draft is accepted exactly when that draw equals it: the tokens are those of the run without drafts, so
    a rolled-back state must leave the next distribution as it was."""
    _, _, worker = hybrid
    without, _ = serve_sampled(redis_server, worker, [])
    with_drafts, (accepted, drafted) = serve_sampled(redis_server, worker, ["--speculative-config", SPEC])
    assert with_drafts == without
    assert 1 <= accepted < drafted, (accepted, drafted)  # drafts accepted and rejected (so rolled back)


def serve_sampled(redis_server, worker, flags: list) -> tuple[dict[int, list[list[int]]], tuple[float, float]]:
    """The repetitive cases() prompts, each with a SAMPLED setting, concurrently through a fresh scheduler: the
    sequences and (accepted, drafted) draft tokens."""
    loops = cases()[:3]  # the repetitive prompts: the lookup drafts there
    jobs = [(prompt, max_tokens, params) for (prompt, max_tokens, _), params in zip(loops, SAMPLED, strict=True)]
    results, got = serve_concurrently(redis_server, worker, jobs, flags, "hybrid-spec-sampled")
    return results, (got.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
                     got.get("vllm:spec_decode_num_draft_tokens_total", 0.0))


def serve_and_compare(redis_server, hf, worker, flags: list, min_accepted: int = 1) -> None:
    """Serve cases() concurrently through a fresh scheduler: every sequence equals transformers', and of the drafts
    at least `min_accepted` were accepted and some rejected (and so rolled back)."""
    jobs = [(prompt, max_tokens, dict(temperature=0.0, n=n)) for prompt, max_tokens, n in cases()]
    results, got = serve_concurrently(redis_server, worker, jobs, flags, "hybrid-spec")
    for i, (prompt, max_tokens, n) in enumerate(cases()):
        assert results[i] == [reference(hf, prompt, max_tokens)] * n, f"case {i} differs from transformers"
    drafted = got["vllm:spec_decode_num_draft_tokens_total"]
    accepted = got["vllm:spec_decode_num_accepted_tokens_total"]
    assert min_accepted <= accepted < drafted, (accepted, drafted)  # some drafts rolled back
