"""-O1 (the compiled forward) on hybrid models served by a real stack: worker process, scheduler process,
redis-server, on random-weight checkpoints transformers wrote here (Qwen3.5 with its own random MTP layer; Nemotron-H).
Four state slots, a 12-block KV pool of 16 tokens, a 32-token step budget, every step of up to 32 tokens padded to the
one compiled size:

- mixed prompt lengths arriving apart and an n = 2 request, prefilled in chunks beside decodes: the pool runs dry
  (preemptions counted, each recomputed from zero state), greedy tokens equal transformers' float32 ones (and so the
  eager worker's, tests/e2e/test_hybrid_serving.py);
- Qwen3.5 with MTP drafts through a second scheduler on the same worker: the same tokens;
- once idle, no request holds a state slot and the ledger's slots add up;
- (slow) on two gloo ranks, each compiling its shard (the all-reduces eager between the compiled parts): the logits
  of chunked prefill and decode steps equal one eager rank's.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.e2e.test_hybrid_serving import (
    NUM_STATE_SLOTS,
    SCHEDULER_ARGS,
    TIMEOUT_S,
    WORKER_ARGS,
    generate,
    reference,
    token_prompt,
)
from tests.e2e.test_model_families_served import word_tokenizer
from tests.e2e.test_prefix_cache import wait_for
from tests.e2e.test_scheduler_e2e import assert_clean_log, metrics
from tests.support import cluster
from tests.support.rank_pair import run_on_ranks
from worker_svc.config import CompilationConfig
from worker_svc.parallel.sharding import Shard

SIZES = json.dumps({"cudagraph_capture_sizes": [32]})  # the step budget: every step compiled, decodes padded
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
COMPILE_TIMEOUT_S = 900  # a cold inductor compile on a shared 2-core box


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


def serve_mixed(address: str, port: int, hf) -> None:
    """Three prompts that outgrow the pool together, one arriving later with n = 2: transformers' tokens."""
    prompts = [token_prompt(n, 500 + n) for n in (60, 45, 52, 20)]
    max_tokens = [40, 40, 40, 12]
    results: dict[int, list[list[int]]] = {}

    def run(i: int) -> None:
        time.sleep(0.05 * max(0, i - 2))
        results[i] = generate(address, prompts[i], max_tokens[i], n=2 if i == 3 else 1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert metrics(port).get("vllm:num_preemptions_total", 0) > 0, "the KV pool was meant to run dry"
    for i, p in enumerate(prompts):
        expected = reference(hf, p, max_tokens[i])
        assert all(seq == expected for seq in results[i]), f"prompt {i} ({len(p)} tokens) differs from transformers"
    assert len(results[3]) == 2


def assert_slots_all_back(redis_url: str, namespace: str) -> None:
    ledger = cluster.ledger(redis_url, namespace)
    state = wait_for("an idle ledger", lambda: (x := ledger.check_ledger())["active"] == 0 and x, timeout=30)
    assert state["state_slots"] == NUM_STATE_SLOTS and state["state_overlap"] == 0
    assert state["state_free"] + state["state_owned"] == NUM_STATE_SLOTS
    assert not any(r.startswith(b"r:") for r in ledger.client.hvals(ledger.prefix + "sslot")), "a leaked slot"


# Nemotron-H compiled equals eager and transformers in tests/service/test_compiled_hybrid.py; served, it is slow.
@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("nemotron_h", marks=pytest.mark.slow)])
def test_compiled_hybrid_worker_serves_transformers_tokens(redis_server, tmp_path, inductor_cache, family):
    from tests.service.test_hybrid_families import make_checkpoint

    hf = make_checkpoint(family, tmp_path)
    word_tokenizer(tmp_path, hf.config.vocab_size)
    spec = []
    if family == "qwen3_5":
        from tests.support.spec_heads import add_mtp_layer

        add_mtp_layer(str(tmp_path))
        spec = ["--speculative-config", MTP]
    worker = cluster.start_worker(["--model", str(tmp_path), *WORKER_ARGS, "-O1", "--compilation-config", SIZES,
                                   *spec], timeout=COMPILE_TIMEOUT_S, env=inductor_cache)
    procs = [worker]
    try:
        assert "compiled forward ready: sizes [32]" in worker.log_text()
        for flags in ([], spec) if spec else ([],):
            port = cluster.free_port()
            ns = cluster.new_namespace(f"compiled-{family}")
            sched = cluster.start_scheduler(redis_server, worker, [*SCHEDULER_ARGS, "--metrics-port", port, *flags],
                                            namespace=ns)
            procs.append(sched)
            cluster.wait_healthy(sched.address, timeout=120, proc=sched)
            serve_mixed(sched.address, port, hf)
            if flags:
                assert metrics(port)["vllm:spec_decode_num_draft_tokens_total"] > 0
            assert_slots_all_back(redis_server, ns)
            cluster.stop(sched)
            assert_clean_log(sched)
    finally:
        for p in procs:
            cluster.stop(p)


def _compiled_rank_steps(path: str, shard: Shard, group):
    from tests.e2e.test_tensor_parallel_hybrid import _load, _steps
    from worker_svc.model.compiled_hybrid import CompiledHybridForward

    compiled = CompiledHybridForward(_load(path, shard, group, prepack=False), CompilationConfig((32,)))
    compiled.warm_up()
    return _steps(compiled), None


@pytest.mark.slow  # two ranks compiling on two cores: ~2.5 min
def test_compiled_on_two_ranks_equals_one_eager_rank(tmp_path, inductor_cache, monkeypatch):
    from tests.e2e.test_tensor_parallel_hybrid import _load, _steps
    from tests.service.test_hybrid_families import make_checkpoint

    make_checkpoint("qwen3_5", tmp_path / "model")
    path = str(tmp_path / "model")
    expected = _steps(_load(path, Shard(0, 1)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache["TORCHINDUCTOR_CACHE_DIR"])  # the spawned ranks'
    ((got, _),) = run_on_ranks(_compiled_rank_steps, [path], str(tmp_path), 2)
    for g, w in zip(got, expected, strict=True):
        assert g.shape == w.shape
        diff = (g - w).abs().max().item()
        assert diff < 2e-4 * max(1.0, w.abs().max().item()), f"compiled N=2: max abs logit diff {diff}"
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()
