"""Gemma 2 (interleaved sliding-window and global layers, soft-capping) served by a real stack: worker process,
scheduler, redis-server. A 16-token step budget chunks every prompt, a 10-block pool of 16 cannot hold the four
sequences at once (preemption and recompute); greedy tokens equal transformers' (up to a step where its own top-2
margin is a near tie). Prompts are token ids, longer than the 16-token window. And a checkpoint with an option the
model would ignore is refused at worker start, naming the config.json field."""

from __future__ import annotations

import json
import subprocess
import threading

import grpc
import pytest
import torch

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_prefix_cache import metrics
from tests.support import cluster

MAX_TOKENS = 12
PROMPT_LENGTHS = (60, 45, 52, 38)
WORKER_ARGS = ["--num-gpu-blocks-override", 10, "--max-model-len", 128, "--allow-kv-pool-below-max-model-len"]
SCHEDULER_ARGS = ["--max-num-batched-tokens", 16, "--debug-invariants"]
TIMEOUT_S = 600


def word_tokenizer(path, vocab_size: int) -> None:
    """tokenizer.json with one word per id (the scheduler loads the model directory's tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from tests.service.test_model_families import make_checkpoint, prompts

    path = tmp_path_factory.mktemp("gemma2-served")
    hf = make_checkpoint("gemma2", path, max_position_embeddings=128)
    word_tokenizer(path, hf.config.vocab_size)
    ids = prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    reference = []
    for p in ids:
        out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0)
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        reference.append((out.sequences[0, len(p):].tolist(), margins))
    return str(path), ids, reference


def generate(address: str, ids: list[int], rid: str, out: dict) -> None:
    req = pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True,
                                                                        max_tokens=MAX_TOKENS))
    req.token_ids.SetInParent()
    req.token_ids.ids.extend(ids)
    tokens = []
    with grpc.insecure_channel(address) as channel:
        for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=TIMEOUT_S):
            tokens.extend(msg.token_ids)
    out[rid] = tokens


def test_gemma2_served_with_chunked_prefill_and_preemption_matches_hf(redis_server, gemma2):
    path, ids, reference = gemma2
    worker = cluster.start_worker(["--model", path, *WORKER_ARGS])
    sched = None
    try:
        metrics_port = cluster.free_port()
        sched = cluster.start_scheduler(redis_server, worker, [*SCHEDULER_ARGS, "--metrics-port", metrics_port])
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        results: dict[str, list[int]] = {}
        threads = [threading.Thread(target=generate, args=(sched.address, p, f"g{i}", results))
                   for i, p in enumerate(ids)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert metrics(metrics_port).get("vllm:num_preemptions_total", 0) > 0, "the pool was meant to run dry"
        for i, (expected, margins) in enumerate(reference):
            got = results[f"g{i}"]
            assert len(got) == MAX_TOKENS
            agreed = next((s for s, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), MAX_TOKENS)
            assert agreed == MAX_TOKENS or margins[agreed] < 1e-2, \
                f"prompt {i}: token {agreed} differs from transformers' at a clear margin ({margins[agreed]:.3f})"
            assert agreed >= MAX_TOKENS // 2, f"prompt {i}: only {agreed} tokens compared"
    finally:
        if sched is not None:
            cluster.stop(sched)
        cluster.stop(worker)


def test_unsupported_option_refused_at_worker_start(gemma2, tmp_path):
    path = gemma2[0]
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(f"{path}/{name}")
    config = json.loads(open(f"{path}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_activation": "relu"}))
    argv = [*map(str, cluster.processes.cli_argv("worker", "--port", "0", "--model", str(tmp_path)))]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "hidden_activation='relu'" in proc.stderr + proc.stdout, (proc.stderr + proc.stdout)[-2000:]
