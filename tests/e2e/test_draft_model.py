"""Speculative decoding with a draft model end to end (real worker, scheduler and Redis; random-weight transformers
checkpoints of one family and one vocabulary, the draft smaller than the target).

- Greedy: with a 16-token step budget (chunked prefill), a 10-block pool (preemption and recompute), prefix caching
  and n = 2, every sequence equals the one the same target gives without speculation.
- Sampled: many seeded draws of a 3-token continuation; the token histograms with the draft model (rejection
  sampling) and without it agree within a chi-square bound (seeded: the same counts every run).
- The bundled model as its own draft accepts nearly every greedy draft (from the vllm:spec_decode_* metrics), with
  preemption and n = 2 forks rebuilding and copying the draft's KV, and its text equals plain decoding's.
- A draft with another vocabulary is refused at worker start, naming the field.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from scipy import stats

from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_model_families_served import word_tokenizer
from tests.e2e.test_scheduler_e2e import assert_clean_log, make_request, metrics, run_concurrently, wait_idle_ledger
from tests.support import cluster

K = 3
TIMEOUT_S = 600
POOL = ["--num-gpu-blocks-override", 10, "--max-model-len", 160, "--allow-kv-pool-below-max-model-len"]
SCHEDULER = ["--max-num-batched-tokens", 16, "--debug-invariants"]
DRAFT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)


def spec(model: str, k: int = K) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.service.test_model_families import make_checkpoint

    out = {}
    for name, fields in (("target", {}), ("draft", DRAFT), ("other-vocab", {**DRAFT, "vocab_size": 256})):
        path = tmp_path_factory.mktemp(f"spec-{name}")
        hf = make_checkpoint("llama", path, max_position_embeddings=160, **fields)
        word_tokenizer(path, hf.config.vocab_size)
        out[name] = str(path)
    return out


def start(redis_url: str, worker_flags: list, scheduler_flags: list, batch_tokens: int = 16):
    worker = cluster.start_worker(worker_flags)
    port = cluster.free_port()
    sched = cluster.start_scheduler(redis_url, worker, ["--max-num-batched-tokens", batch_tokens,
                                                        "--debug-invariants", "--metrics-port", port,
                                                        *scheduler_flags])
    sched.extra["metrics_port"] = port
    cluster.wait_healthy(sched.address, timeout=120, proc=sched)
    return worker, sched


def stop(redis_url: str, worker, sched, num_blocks: int) -> dict[str, float]:
    got = metrics(sched.extra["metrics_port"])
    wait_idle_ledger(redis_url, sched.namespace, num_blocks)
    cluster.stop(sched)
    cluster.stop(worker)
    assert_clean_log(sched)
    return got


def generate(address: str, prompt, max_tokens: int, **sampling) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    with grpc.insecure_channel(address) as ch:
        for m in pb_grpc.LLMServeStub(ch).Generate(make_request(prompt, max_tokens, **sampling), timeout=TIMEOUT_S):
            out[m.index] = out.get(m.index, []) + list(m.token_ids)
    return out


def greedy_cases() -> list[tuple[list[int], dict]]:
    gen = np.random.default_rng(3)
    shared = gen.integers(0, 320, 40).tolist()  # two prompts share 2 full blocks: a prefix-cache hit
    return [(gen.integers(0, 320, 60).tolist(), {}), (shared + gen.integers(0, 320, 10).tolist(), {}),
            (shared + gen.integers(0, 320, 5).tolist(), {"n": 2}), (gen.integers(0, 320, 38).tolist(), {})]


def run_cases(address: str, cases, max_tokens: int) -> list[dict[int, list[int]]]:
    return run_concurrently([lambda p=p, kw=kw: generate(address, p, max_tokens, **kw) for p, kw in cases])


def test_greedy_with_a_draft_model_equals_plain_decoding(redis_server, checkpoints):  # noqa: F811
    cases = greedy_cases()
    worker, sched = start(redis_server, ["--model", checkpoints["target"], *POOL], [])
    plain = run_cases(sched.address, cases, 12)
    stop(redis_server, worker, sched, 10)
    flags = ["--speculative-config", spec(checkpoints["draft"])]
    worker, sched = start(redis_server, ["--model", checkpoints["target"], *POOL, *flags], flags)
    spec_out = run_cases(sched.address, cases, 12)
    got = stop(redis_server, worker, sched, 10)
    assert spec_out == plain
    assert got.get("vllm:num_preemptions_total", 0) > 0, "the run was meant to preempt"
    assert got["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert got["vllm:spec_decode_num_drafts_total"] > 0


N_DRAWS = 240


def draws(address: str, prompt: list[int]) -> np.ndarray:
    """[N_DRAWS, 3] tokens of seeded samples of one prompt."""
    outs = run_concurrently([lambda s=s: generate(address, prompt, 3, temperature=1.5, top_k=6, seed=1000 + s)[0]
                             for s in range(N_DRAWS)], start_together=False)
    return np.array(outs)


def test_sampled_distribution_with_a_draft_model_equals_plain_sampling(redis_server, checkpoints):  # noqa: F811
    prompt = np.random.default_rng(5).integers(0, 320, 20).tolist()
    pool = ["--num-gpu-blocks-override", 400, "--max-model-len", 160]
    worker, sched = start(redis_server, ["--model", checkpoints["target"], *pool], ["--max-num-seqs", 256], 512)
    plain = draws(sched.address, prompt)
    stop(redis_server, worker, sched, 400)
    flags = ["--speculative-config", spec(checkpoints["draft"], 2)]
    worker, sched = start(redis_server, ["--model", checkpoints["target"], *pool, *flags],
                          ["--max-num-seqs", 256, *flags], 512)
    with_draft = draws(sched.address, prompt)
    got = stop(redis_server, worker, sched, 400)
    # The first token is sampled at the end of the prompt, without drafts: the same draw, seed for seed.
    assert (plain[:, 0] == with_draft[:, 0]).all()
    assert got["vllm:spec_decode_num_draft_tokens_total"] > got["vllm:spec_decode_num_accepted_tokens_total"] > 0, \
        "the case was meant to reject some drafts and accept others"
    for col in (1, 2):
        tokens = np.union1d(plain[:, col], with_draft[:, col])
        table = np.array([[np.sum(run[:, col] == t) for t in tokens] for run in (plain, with_draft)])
        table = table[:, table.sum(axis=0) >= 5]  # the chi-square approximation needs expected counts >= ~5
        assert table.shape[1] >= 2, table
        assert stats.chi2_contingency(table).pvalue > 1e-3, (col, table)


def test_the_bundled_model_as_its_own_draft_accepts_nearly_every_token(redis_server, bundled_model_path):  # noqa: F811
    prompts = [("1, 2, 3, 4, 5,", {}), ("The capital of France is", {"n": 2}), ("def add(a, b):\n", {})]
    pool = ["--num-gpu-blocks-override", 8, "--max-model-len", 128, "--allow-kv-pool-below-max-model-len"]
    flags = ["--speculative-config", spec(bundled_model_path)]
    worker, sched = start(redis_server, [*pool, *flags], [], 32)
    plain = run_cases(sched.address, prompts, 40)  # no grants: the draft only follows the target's KV
    cluster.stop(sched)
    port = cluster.free_port()
    sched = cluster.start_scheduler(redis_server, worker, ["--max-num-batched-tokens", 32, "--debug-invariants",
                                                           "--metrics-port", port, *flags])
    sched.extra["metrics_port"] = port
    cluster.wait_healthy(sched.address, timeout=120, proc=sched)
    spec_out = run_cases(sched.address, prompts, 40)
    got = stop(redis_server, worker, sched, 8)
    assert spec_out == plain
    assert got.get("vllm:num_preemptions_total", 0) > 0, "the run was meant to preempt"
    drafted = got["vllm:spec_decode_num_draft_tokens_total"]
    accepted = got["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 30 and accepted / drafted > 0.9, (drafted, accepted)


def test_a_draft_with_another_vocabulary_is_refused(checkpoints):
    res = subprocess.run([sys.executable, "-m", "llmserve.cli", "worker", "--port", "0", "--dtype", "float32",
                          "--model", checkpoints["target"], "--speculative-config", spec(checkpoints["other-vocab"])],
                         capture_output=True, text=True, timeout=300, cwd=cluster.ROOT)
    assert res.returncode != 0
    for word in ("--speculative-config", "model", "vocab_size 256", "320"):
        assert word in res.stderr, res.stderr
