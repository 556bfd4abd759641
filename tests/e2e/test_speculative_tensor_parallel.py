"""Speculation on two tensor-parallel ranks (gloo, this CPU), served by a real worker group, scheduler and
redis-server: the target sharded over the ranks, the proposer whole on rank 0 (a draft model; an EAGLE-3 head or
a checkpoint's MTP layer over the target's hidden states, which the all-reduce leaves whole on every rank, with
the target's vocabulary gathered to rank 0 at start). Its drafts reach the other rank as the verifying step's
tokens. Greedy output equals transformers' (float32; what one rank gives without speculation) for concurrent
prompts with chunked prefill and n = 2, while drafts are verified and counted:

- draft_model: the target itself as the draft (nearly every draft accepted), and a smaller random draft of the
  same vocabulary (nearly every draft rejected);
- eagle3: a random-weight head beside a Llama target with an untied LM head;
- mtp: a Qwen3.5 checkpoint's own random-weight MTP layer (rejected drafts roll back out of both ranks' shards of
  the recurrent state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_hybrid_serving import reference, token_prompt
from tests.support import cluster
from tests.support.concurrent_serving import serve_concurrently
from tests.support.spec_heads import VOCAB, add_mtp_layer, write_eagle3_head, write_llama_target

K = 3
TIMEOUT_S = 600
POOL = ["--dtype", "float32", "--num-gpu-blocks-override", 64, "--max-model-len", 256,
        "--allow-kv-pool-below-max-model-len", "--tensor-parallel-size", 2]


def cases() -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, n): a repeating prompt and plain ones of several lengths (chunked at 32 tokens)."""
    loop = (token_prompt(4, 700) * 10)[:40]
    return [(loop, 20, 1), (token_prompt(45, 701), 16, 2), (token_prompt(9, 702), 20, 1),
            (token_prompt(23, 703), 16, 1)]


def spec(method: str, model: str | None = None) -> str:
    return json.dumps({"method": method, "num_speculative_tokens": K, **({"model": model} if model else {})})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.support.random_weights import randomize

    root = tmp_path_factory.mktemp("tp-spec")
    target = write_llama_target(str(root / "target"))
    torch.manual_seed(3)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=512)).eval()
    randomize(draft)
    draft.save_pretrained(str(root / "draft"))
    for path in (target, str(root / "draft")):
        word_tokenizer(Path(path), VOCAB)  # the scheduler detokenizes; a draft shares the target's tokenizer
    head = write_eagle3_head(str(root / "eagle3"))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return hf, target, str(root / "draft"), head


@pytest.mark.parametrize("which", ["itself", "small"])
def test_a_draft_model_on_two_ranks_equals_transformers(redis_server, llama, which):
    hf, target, draft, _ = llama
    flags = ["--speculative-config", spec("draft_model", target if which == "itself" else draft)]
    drafted, accepted = serve_and_compare(redis_server, hf, ["--model", target, *POOL, *flags], flags)
    if which == "itself":
        assert accepted > 0.9 * drafted, (accepted, drafted)
    else:
        assert accepted < drafted, (accepted, drafted)


def test_an_eagle3_head_on_two_ranks_equals_transformers(redis_server, llama):
    hf, target, _, head = llama
    flags = ["--speculative-config", spec("eagle3", head)]
    drafted, accepted = serve_and_compare(redis_server, hf, ["--model", target, *POOL, *flags], flags)
    assert accepted < drafted


def test_mtp_on_two_ranks_equals_transformers(redis_server, tmp_path):
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_hybrid_families import make_checkpoint

    hf = make_checkpoint("qwen3_5", tmp_path)
    word_tokenizer(tmp_path, hf.config.vocab_size)
    add_mtp_layer(str(tmp_path))
    flags = ["--speculative-config", spec("mtp")]
    drafted, accepted = serve_and_compare(redis_server, hf, ["--model", str(tmp_path), *POOL, "--num-state-slots", 6,
                                                             *flags], flags)
    assert accepted < drafted


def serve_and_compare(redis_server, hf, worker_flags: list, flags: list) -> tuple[float, float]:
    """Serve cases() concurrently through a two-rank worker and a scheduler granting draft slots: every sequence
    equals transformers'; (drafted, accepted) from the vllm:spec_decode_* metrics (some drafts verified)."""
    worker = cluster.start_worker(worker_flags, timeout=TIMEOUT_S)
    try:
        jobs = [(prompt, max_tokens, dict(temperature=0.0, n=n)) for prompt, max_tokens, n in cases()]
        results, got = serve_concurrently(redis_server, worker, jobs, flags, "tp-spec")
        for i, (prompt, max_tokens, n) in enumerate(cases()):
            assert results.get(i) == [reference(hf, prompt, max_tokens)] * n, f"case {i} differs from transformers"
        drafted = got["vllm:spec_decode_num_draft_tokens_total"]
        assert drafted > 0
        return drafted, got["vllm:spec_decode_num_accepted_tokens_total"]
    finally:
        cluster.stop(worker)
