"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside attention) served by a real stack: worker process, scheduler
process, redis-server, on a random-weight checkpoint transformers wrote here. Four state slots and a 12-block KV
pool of 16 tokens, a 32-token step budget:

- mixed prompt lengths arriving apart and an n = 2 request: the pool runs dry (preemptions counted, each recomputed
  from zero state), greedy tokens equal transformers' float32 ones;
- prefix caching by state snapshots: a repeated 40-token prompt hits 32 tokens (its last full block boundary), an
  extended conversation hits at the previous turn's last boundary (48), both with transformers' tokens;
- kill -9 of the scheduler and of the worker mid-stream: every stream identical to the uninterrupted run, and the
  ledger's state slots all free once idle.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import torch

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_model_families_served import word_tokenizer
from tests.e2e.test_prefix_cache import metrics, wait_for
from tests.support import cluster
from tests.support.concurrent_serving import request_tokens

NUM_STATE_SLOTS = 4
WORKER_ARGS = ["--num-gpu-blocks-override", 12, "--max-model-len", 256, "--allow-kv-pool-below-max-model-len",
               "--num-state-slots", NUM_STATE_SLOTS]
SCHEDULER_ARGS = ["--max-num-batched-tokens", 32, "--debug-invariants", "--lease-ttl-ms", 2000]
TIMEOUT_S = 600
KILL_TOKENS = 40  # long enough that a kill lands mid-stream


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from tests.service.test_hybrid_families import make_checkpoint

    path = tmp_path_factory.mktemp("qwen3_5-served")
    hf = make_checkpoint("qwen3_5", path)
    word_tokenizer(path, hf.config.vocab_size)
    return str(path), hf


def reference(hf, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def token_prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(address: str, ids: list[int], max_tokens: int, n: int = 1, rid: str | None = None) -> list[list[int]]:
    """Greedy; one token list per sequence."""
    return request_tokens(address, ids, max_tokens, dict(temperature=0.0, n=n), rid, timeout=TIMEOUT_S)


class Stream:
    """One greedy request followed to its end across scheduler kills, re-attaching with resume_from_token."""

    def __init__(self, address: str, ids: list[int], max_tokens: int):
        self.rid, self.address, self.ids, self.max_tokens = f"h-{uuid.uuid4().hex[:8]}", address, ids, max_tokens
        self.tokens: list[int] = []
        self.finish, self.sessions, self.problems = "", 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        req = pb.GenerateRequest(request_id=self.rid, sampling=pb.SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=self.max_tokens))
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(self.ids)
        deadline = time.monotonic() + TIMEOUT_S
        while not self.finish and time.monotonic() < deadline:
            req.resume_from_token = len(self.tokens)
            try:
                with grpc.insecure_channel(self.address) as channel:
                    self.sessions += 1
                    for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=TIMEOUT_S):
                        if msg.token_ids and msg.first_token_index != len(self.tokens):
                            self.problems.append(f"token {msg.first_token_index} after {len(self.tokens)}")
                        self.tokens.extend(msg.token_ids)
                        self.finish = msg.finish_reason or self.finish
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.problems.append(f"{e.code().name}: {e.details()}")
                    return
                time.sleep(0.2)

    def join(self) -> list[int]:
        self.thread.join(TIMEOUT_S)
        assert not self.problems and self.finish == "length", (self.rid, self.problems, self.finish)
        return self.tokens


class Served:
    """The module's worker (restartable on its fixed port) and one scheduler with metrics, for the tests that only
    read it."""

    def __init__(self, redis_url: str, path: str):
        self.redis_url, self.path = redis_url, path
        self.worker_port = cluster.free_port()
        self.worker = self.start_worker()
        self.metrics_port = cluster.free_port()
        self.sched = cluster.start_scheduler(redis_url, self.worker_address,
                                             [*SCHEDULER_ARGS, "--metrics-port", self.metrics_port],
                                             namespace=cluster.new_namespace("hybrid"))
        cluster.wait_healthy(self.sched.address, timeout=120, proc=self.sched)

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    def start_worker(self) -> cluster.Proc:
        return cluster.start_worker(["--model", self.path, *WORKER_ARGS, "--port", self.worker_port])

    def metrics(self) -> dict[str, float]:
        return metrics(self.metrics_port)


@pytest.fixture(scope="module")
def served(redis_server, hybrid):
    s = Served(redis_server, hybrid[0])
    try:
        yield s
    finally:
        cluster.stop(s.sched)
        cluster.stop(s.worker)


def test_few_state_slots_preempt_n2_and_mixed_lengths_match_hf(served, hybrid):
    sched, hf = served.sched, hybrid[1]
    prompts = [token_prompt(n, seed) for seed, n in enumerate([60, 45, 52, 38, 20])]
    # The first three arrive together and each grows to 6-7 blocks (48 tokens out), so any two of them running
    # at once outgrow the 12-block pool whatever the machine's speed: preemption is certain, not a race. The
    # others arrive apart and join a running batch.
    max_tokens = [48, 48, 48, 12, 12]
    results: dict[int, list[list[int]]] = {}

    def run(i: int) -> None:
        time.sleep(0.05 * max(0, i - 2))
        results[i] = generate(sched.address, prompts[i], max_tokens[i], n=2 if i == 3 else 1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    m = served.metrics()
    assert m.get("vllm:num_preemptions_total", 0) > 0, "the KV pool was meant to run dry"
    assert "llmserve:state_slot_usage_perc" in m and "llmserve:state_snapshots" in m
    for i, p in enumerate(prompts):
        expected = reference(hf, p, max_tokens[i])
        assert all(seq == expected for seq in results[i]), f"prompt {i} ({len(p)} tokens) differs from transformers"
    assert len(results[3]) == 2


def check_prefix_hits(address: str, hits_total, hf) -> None:
    """A repeated 40-token prompt hits 32 tokens; a next turn extending a finished one hits at its last boundary."""
    p = token_prompt(40, 100)
    before = hits_total()
    (cold,) = generate(address, p, 8)
    (warm,) = generate(address, p, 8)
    assert hits_total() - before == 32, "a repeat of a 40-token prompt starts from its snapshot at 32 tokens"
    assert warm == cold == reference(hf, p, 8)

    turn1 = token_prompt(21, 101)
    (out1,) = generate(address, turn1, 30)
    turn2 = turn1 + out1 + token_prompt(9, 102)  # the next turn extends the whole previous one
    before = hits_total()
    (out2,) = generate(address, turn2, 8)
    assert hits_total() - before == 48  # the last block boundary turn 1 reached (its KV and state up to 50)
    assert out2 == reference(hf, turn2, 8)


def test_prefix_hits_on_a_repeated_prompt_and_an_extended_conversation(served, hybrid):
    check_prefix_hits(served.sched.address, lambda: served.metrics().get("vllm:prefix_cache_hits_total", 0),
                      hybrid[1])
    assert 0 < served.metrics()["llmserve:state_snapshot_share"] <= 0.5


def test_mamba2_hybrid_prefix_hits_and_preemption(redis_server, tmp_path):
    """Nemotron-H (Mamba2 layers beside attention): the same scheduler side on another state shape."""
    from tests.service.test_hybrid_families import make_checkpoint

    hf = make_checkpoint("nemotron_h", tmp_path)
    word_tokenizer(tmp_path, hf.config.vocab_size)
    worker = cluster.start_worker(["--model", str(tmp_path), *WORKER_ARGS])
    port = cluster.free_port()
    sched = cluster.start_scheduler(redis_server, worker, [*SCHEDULER_ARGS, "--metrics-port", port],
                                    namespace=cluster.new_namespace("mamba2"))
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        check_prefix_hits(sched.address, lambda: metrics(port).get("vllm:prefix_cache_hits_total", 0), hf)
        prompts = [token_prompt(n, 300 + n) for n in (60, 45, 52)]
        results: dict[int, list[int]] = {}
        # 48 tokens out: each grows to 6-7 blocks, so any two running at once outgrow the 12-block pool.
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(sched.address, prompts[i],
                                                                                       48)[0]))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert metrics(port).get("vllm:num_preemptions_total", 0) > 0
        assert [results[i] for i in range(3)] == [reference(hf, p, 48) for p in prompts]
    finally:
        cluster.stop(sched)
        cluster.stop(worker)


@pytest.mark.parametrize("which", ["scheduler", "worker"])
def test_kill_9_mid_stream_every_stream_identical(redis_server, served, which):
    """A scheduler killed mid-stream is replaced on its port (clients re-attach); a worker killed mid-stream is
    restarted on its port (the scheduler resumes every request by recompute: state from zero or a snapshot)."""
    ns = cluster.new_namespace(f"hybrid-kill-{which}")
    port = cluster.free_port()
    args = [*SCHEDULER_ARGS, "--port", port]
    sched = cluster.start_scheduler(redis_server, served.worker_address, args, namespace=ns)
    procs = [sched]
    try:
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        prompts = [token_prompt(n, 200 + n) for n in (30, 41, 17)]
        expected = [generate(sched.address, p, KILL_TOKENS)[0] for p in prompts]  # uninterrupted, one at a time
        streams = [Stream(sched.address, p, KILL_TOKENS) for p in prompts]
        ledger = cluster.ledger(redis_server, ns)
        wait_for("4 committed tokens each", lambda: all(
            (r := ledger.get_request(s.rid)) is not None and len(r.output_ids) >= 4 for s in streams), timeout=120)
        assert all(len(ledger.get_request(s.rid).output_ids) < KILL_TOKENS for s in streams), "not mid-stream"
        if which == "scheduler":
            cluster.kill(sched)
            sched = cluster.start_scheduler(redis_server, served.worker_address, args, namespace=ns)
            procs.append(sched)
        else:
            cluster.kill(served.worker)
            served.worker = served.start_worker()
        assert [s.join() for s in streams] == expected
        if which == "scheduler":
            assert all(s.sessions >= 2 for s in streams), "a stream never re-attached"
        state = wait_for("an idle ledger", lambda: (x := ledger.check_ledger())["active"] == 0 and x, timeout=30)
        assert state["state_slots"] == NUM_STATE_SLOTS and state["state_overlap"] == 0
        assert state["state_free"] + state["state_owned"] == NUM_STATE_SLOTS
        assert not any(r.startswith(b"r:") for r in ledger.client.hvals(ledger.prefix + "sslot"))
    finally:
        for p in procs:
            cluster.stop(p)
