"""LoRA on hybrid models served by a real stack (worker and scheduler processes, redis-server, the HTTP API) on
random-weight Qwen3.5 (Gated DeltaNet + gated attention) and Nemotron-H (Mamba2 + attention + MLP blocks)
checkpoints transformers wrote here, with random adapters in the PEFT layout given by --lora-modules:

- one batch mixing base-model requests and requests of two adapters (every served module; the attention ones
  only): greedy tokens equal transformers' float32 with each adapter merged into its weights, and a repeated
  adapter prompt hits its own state snapshot with the same tokens;
- /v1/load_lora_adapter of an adapter naming a recurrent layer's module is a 400 naming the file and the module;
- tensor parallel 2 (two gloo ranks, each holding its shard of the weights and of the adapters: Qwen's gated
  q_proj per head, Granite's fused [gate | up] by both halves) gives one rank's logits with the adapters, and a
  Qwen3.5 worker on two ranks serves a mixed batch with transformers' tokens.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_hybrid_serving import reference, token_prompt
from tests.e2e.test_lora_e2e import post
from tests.service.test_hybrid_lora import SERVED, adapters, chunked_logits, sequences, with_pool
from tests.support import cluster
from tests.support.concurrent_serving import summed_metrics
from tests.support.lora_adapters import linear_modules, merged, write_modules
from tests.support.rank_pair import run_on_ranks
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import Shard, local_config

TIMEOUT_S = 600
MAX_TOKENS = 10
LORA = ["--enable-lora", "--max-loras", 2]


def write_adapters(hf, path: Path, name: str) -> dict[str, str]:
    """Adapter "a" on every module the family serves, "b" on the attention projections; non-zero B."""
    modules, skip, _ = SERVED[name]
    a = write_modules(str(path / "a"), linear_modules(hf, modules, skip), modules, rank=8, alpha=16, seed=11,
                      std_b=0.3)
    b = write_modules(str(path / "b"), linear_modules(hf, modules[:4]), modules[:4], rank=4, alpha=8, seed=12,
                      std_b=0.3)
    return {"a": a, "b": b}


class Stack:
    def __init__(self, redis_url: str, name: str, root: Path):
        from tests.e2e.test_model_families_served import word_tokenizer
        from tests.service.test_hybrid_families import make_checkpoint

        self.path = root / name
        self.hf = make_checkpoint(name, self.path)
        word_tokenizer(self.path, self.hf.config.vocab_size)
        self.name, self.adapters = name, write_adapters(self.hf, self.path, name)
        self.oracles = {"": self.hf, **{n: merged(self.hf, p) for n, p in self.adapters.items()}}
        recurrent = SERVED[name][2]
        self.bad = write_modules(str(self.path / "bad"), linear_modules(self.hf, recurrent[:1]),
                                 ("q_proj", recurrent[0]), rank=4, alpha=4)
        modules = [f"{n}={p}" for n, p in self.adapters.items()]
        self.worker = cluster.start_worker(["--model", str(self.path), "--num-gpu-blocks-override", 32,
                                            "--max-model-len", 256, "--allow-kv-pool-below-max-model-len",
                                            "--num-state-slots", 16, *LORA, "--max-lora-rank", 8,
                                            "--lora-modules", *modules],
                                           timeout=TIMEOUT_S)
        self.metrics_port = cluster.free_port()
        self.sched = cluster.start_scheduler(
            redis_url, self.worker, ["--max-num-batched-tokens", 32, "--debug-invariants", "--metrics-port",
                                     self.metrics_port, *LORA, "--lora-modules", *modules,
                                     "--allow-runtime-lora-updating"], namespace=cluster.new_namespace("hyb-lora"))
        self.procs = [self.worker, self.sched]
        cluster.wait_healthy(self.sched.address, timeout=120, proc=self.sched)
        self.api = cluster.start_api(self.sched.address)
        self.procs.append(self.api)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            cluster.stop(proc)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def stack(request, redis_server, tmp_path_factory):
    s = Stack(redis_server, request.param, tmp_path_factory.mktemp(f"{request.param}-lora-served"))
    yield s
    s.stop()


def generate(address: str, ids: list[int], lora: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    req = pb.GenerateRequest(request_id=f"hl-{uuid.uuid4().hex[:8]}", lora_name=lora,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.SetInParent()
    req.token_ids.ids.extend(ids)
    with grpc.insecure_channel(address) as channel:
        return [t for m in pb_grpc.LLMServeStub(channel).Generate(req, timeout=TIMEOUT_S) for t in m.token_ids]


def mixed_batch(address: str, oracles: dict, prompts: list[list[int]], what: str) -> list[list[int]]:
    """Every prompt under the base model and each adapter, all at once: each equals its oracle's greedy tokens."""
    jobs = [(lora, p) for p in prompts for lora in oracles]
    want = [reference(oracles[lora], p, MAX_TOKENS) for lora, p in jobs]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = generate(address, jobs[i][1], jobs[i][0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert [got.get(i) for i in range(len(jobs))] == want, what
    for i in range(0, len(jobs), len(oracles)):  # at these margins each adapter changes the greedy tokens
        assert all(want[i] != want[i + k] for k in range(1, len(oracles))), what
    return want


def test_mixed_batch_of_adapters_and_base_equals_transformers(stack):
    prompts = [token_prompt(n, 500 + i) for i, n in enumerate((37, 20))]
    want = mixed_batch(stack.sched.address, stack.oracles, prompts, stack.name)
    # A repeat of an adapter's prompt starts from that adapter's snapshot (the prefix hash carries the adapter).
    hits = summed_metrics(stack.metrics_port).get("vllm:prefix_cache_hits_total", 0)
    assert generate(stack.sched.address, prompts[0], "a") == want[1]
    assert summed_metrics(stack.metrics_port)["vllm:prefix_cache_hits_total"] - hits == 32


def test_adapter_on_a_recurrent_module_is_refused_at_load(stack):
    module = SERVED[stack.name][2][0]
    status, text = post(f"http://127.0.0.1:{stack.api.port}/v1/load_lora_adapter",
                        {"lora_name": "bad", "lora_path": stack.bad})
    assert status == 400, text
    assert f"adapter_config.json: target module '{module}' is a projection of the" in text, text
    assert "(recurrent)" in text and "q_proj" in text, text
    with pytest.raises(grpc.RpcError) as e:  # never registered: no request can ask for it
        generate(stack.sched.address, [1, 2, 3], "bad")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# ----------------------------------------------------------------------------------------- tensor parallel 2


def _rank_logits(path: str, shard: Shard, group) -> tuple[list, None]:
    config, weights = load_hf_dir(path, shard)
    model = models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                                tp=group)
    pool = with_pool(model, config, adapters(Path(path)), shard)
    return chunked_logits(model, pool, sequences(config.vocab_size), 7), None


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory) -> list[tuple[str, torch.nn.Module]]:
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_hybrid_families import make_checkpoint

    out = []
    for name in ("qwen3_5", "granitemoehybrid"):
        path = tmp_path_factory.mktemp(f"{name}-lora-tp")
        hf = make_checkpoint(name, path)
        modules, skip, _ = SERVED[name]
        write_modules(str(path / "all"), linear_modules(hf, modules, skip), modules, rank=4, alpha=8, seed=1,
                      std_b=0.3)
        write_modules(str(path / "attn"), linear_modules(hf, modules[:4]), modules[:4], rank=2, alpha=4, seed=2,
                      std_b=0.3)
        word_tokenizer(path, hf.config.vocab_size)
        out.append((str(path), hf))
    return out


def test_tp2_with_adapters_equals_one_rank(tp_checkpoints, tmp_path):
    paths = [p for p, _ in tp_checkpoints]
    got = run_on_ranks(_rank_logits, paths, str(tmp_path), 2)
    for path, (logits, _) in zip(paths, got, strict=True):
        want, _ = _rank_logits(path, Shard(0, 1), None)
        config, weights = load_hf_dir(path)
        base = chunked_logits(models.by_name(config.architecture)(config, weights, torch.float32, "cpu"), None,
                              sequences(config.vocab_size), 7)
        for i, (g, w) in enumerate(zip(logits, want, strict=True)):
            diff = (g - w).abs().max().item()
            assert diff < 1e-4 * max(1.0, w.abs().max().item()), f"{path} sequence {i}: max abs logit diff {diff}"
            changed = (w - base[i]).abs().max().item() > 1e-2
            assert changed == (i < 2), f"{path} sequence {i}: adapter rows change, base rows do not"


def test_served_on_two_ranks_with_adapters_equals_transformers(redis_server, tp_checkpoints):
    """A --tensor-parallel-size 2 worker: rank 0 sends the adapters it placed and each token's slot with the step,
    beside the plan's state ops; a mixed batch equals transformers."""
    path, hf = tp_checkpoints[0]  # Qwen3.5
    names = adapters(Path(path))
    modules = [f"{n}={p}" for n, p in names.items()]
    worker = cluster.start_worker(["--model", path, "--tensor-parallel-size", 2, "--num-gpu-blocks-override", 24,
                                   "--max-model-len", 256, "--allow-kv-pool-below-max-model-len", "--num-state-slots",
                                   8, *LORA, "--max-lora-rank", 4, "--lora-modules", *modules], timeout=TIMEOUT_S)
    sched = cluster.start_scheduler(redis_server, worker, ["--max-num-batched-tokens", 32, "--debug-invariants", *LORA,
                                                           "--lora-modules", *modules],
                                    namespace=cluster.new_namespace("hyb-lora-tp"))
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        oracles = {"": hf, **{n: merged(hf, p) for n, p in names.items()}}
        mixed_batch(sched.address, oracles, [token_prompt(30, 600)], "qwen3_5 on two ranks")
    finally:
        cluster.stop(sched)
        cluster.stop(worker)
