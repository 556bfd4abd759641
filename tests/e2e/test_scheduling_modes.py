"""--scheduling-mode naive | static | continuous (the benchmark suite's baselines on the same engine).

Pure policy tests first; then real processes, where each mode's batching is read back from the scheduler's
--step-log records (not from timing) and the greedy outputs must be the same in every mode.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import grpc
import pytest

from common.sampling_fields import SamplingParams
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig, schedule
from scheduler_svc.core.request import Request, Status
from tests.support import cluster


def _req(rid: str, prompt_len: int, max_tokens: int, seq: int) -> Request:
    return Request(request_id=rid, prompt_ids=[(seq * 7 + i) % 500 + 1 for i in range(prompt_len)],
                   sampling=SamplingParams(max_tokens=max_tokens), arrival_seq=seq)


def _simulate(mode: str, lengths: list[tuple[int, int]], *, budget: int = 64, max_num_seqs: int = 4,
              chunked: bool = True, num_blocks: int = 256, late: dict[int, list[tuple[int, int]]] | None = None):
    """Run the pure policy to the end (one fake token per request whose known tokens are all computed).
    `late`: step number -> requests arriving before that step. Returns one record per step."""
    cfg = PolicyConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, block_size=16,
                       enable_chunked_prefill=chunked, scheduling_mode=mode, enable_prefix_caching=False)
    pool, waiting, running = BlockPool(num_blocks), deque(), []
    seq = 0

    def arrive(items):
        nonlocal seq
        for p, m in items:
            waiting.append(_req(f"r{seq}", p, m, seq))
            seq += 1

    arrive(lengths)
    records = []
    for step in range(10_000):
        arrive((late or {}).get(step, []))
        if not waiting and not running:
            return records
        before = {r.request_id for r in running}
        out = schedule(waiting, running, pool, cfg)
        records.append({"before": before, "scheduled": dict(out.num_tokens),
                        "admitted": [r.request_id for r in out.admitted]})
        for r in out.scheduled:
            r.num_computed_tokens += out.num_tokens[r.request_id]
            if r.num_computed_tokens == r.num_tokens:
                r.output_ids.append(1)
                if len(r.output_ids) == r.max_tokens:
                    pool.release(r.block_ids)
                    r.block_ids, r.status = [], Status.FINISHED
                    running.remove(r)
    raise AssertionError("runaway simulation")


def test_naive_runs_one_request_at_a_time_with_whole_prompts():
    recs = _simulate("naive", [(100, 3), (20, 2), (300, 1)], budget=32, late={2: [(5, 2)]})
    assert all(len(r["scheduled"]) == 1 for r in recs)
    # Each prompt is prefilled in one step even though it is larger than the 32-token budget.
    prefill_sizes = [n for r in recs for rid, n in r["scheduled"].items() if rid in r["admitted"]]
    assert prefill_sizes == [100, 20, 300, 5]
    assert all(not r["admitted"] or not r["before"] for r in recs)


def test_static_admits_only_into_an_empty_batch():
    recs = _simulate("static", [(40, 5), (40, 1), (40, 3)], budget=32, max_num_seqs=2,
                     late={1: [(10, 1)], 3: [(10, 2)]})
    batches = [set(r["admitted"]) for r in recs if r["admitted"]]
    assert batches == [{"r0", "r1"}, {"r2", "r3"}, {"r4"}]
    for r in recs:
        if r["admitted"]:
            assert not r["before"], "admitted into a running batch"
        # Every request of a step belongs to one batch.
        assert any(set(r["scheduled"]) <= b for b in batches)
    # r1 finished after one token, yet r2 waited until r0 (5 tokens) was done: 5 steps for the first batch.
    first_r2 = next(i for i, r in enumerate(recs) if "r2" in r["admitted"])
    assert first_r2 == 5


def test_continuous_admits_every_step_and_chunks_unless_told_not_to():
    recs = _simulate("continuous", [(40, 5), (100, 2)], budget=32, max_num_seqs=4, late={2: [(8, 2)]})
    joined = next(r for r in recs if "r2" in r["admitted"])
    assert joined["before"] & {"r0", "r1"}  # joined a running batch
    assert max(n for r in recs for n in r["scheduled"].values()) <= 32  # prompts chunked to the budget
    whole = _simulate("continuous", [(40, 5), (30, 2)], budget=64, chunked=False)
    assert whole[0]["scheduled"] == {"r0": 40}  # r1 (30 more) does not fit the rest of the budget whole
    assert whole[1]["scheduled"] == {"r0": 1, "r1": 30}


# ---- real processes ----------------------------------------------------------------------------------------------

PROMPTS = [[(i * 13 + j) % 900 + 20 for j in range(8 + 9 * i)] for i in range(6)]
MAX_TOKENS = [3, 9, 5, 12, 4, 7]


@pytest.fixture(scope="module")
def worker():
    w = cluster.start_worker(["--num-gpu-blocks-override", "256", "--max-model-len", "1024"])
    yield w
    cluster.stop_all()


def _run_all(address: str) -> dict[str, list[int]]:
    stub = pb_grpc.LLMServeStub(grpc.insecure_channel(address))
    out: dict[str, list[int]] = {}

    def one(i: int) -> None:
        req = pb.GenerateRequest(request_id=f"m{i}", token_ids=pb.TokenIds(ids=PROMPTS[i]),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True))
        out[f"m{i}"] = [t for msg in stub.Generate(req, timeout=120) for t in msg.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(redis_server, worker, tmp_path_factory):  # noqa: F811
    """Each mode serves the same 6 concurrent requests; returns mode -> (outputs, step records)."""
    results = {}
    for mode, extra in [("continuous", []), ("static", ["--max-num-seqs", "4"]), ("naive", [])]:
        log = tmp_path_factory.mktemp(mode) / "steps.jsonl"
        sched = cluster.start_scheduler(redis_server, worker, ["--scheduling-mode", mode, "--step-log", str(log),
                                                               "--max-num-batched-tokens", "32", *extra])
        try:
            cluster.wait_healthy(sched.address)
            outputs = _run_all(sched.address)
        finally:
            cluster.stop(sched)
        results[mode] = (outputs, _steps(log))
    return results


def test_every_mode_gives_the_same_greedy_tokens(runs):
    reference = runs["continuous"][0]
    assert sorted(reference) == [f"m{i}" for i in range(6)]
    assert [len(reference[f"m{i}"]) for i in range(6)] == MAX_TOKENS
    for mode in ("static", "naive"):
        assert runs[mode][0] == reference, mode


def test_naive_never_runs_two_requests_together(runs):
    steps = runs["naive"][1]
    assert steps and all(s["mode"] == "naive" for s in steps)
    assert all(len(s["scheduled"]) == 1 for s in steps)
    # One request from admission to its finish, then the next: no interleaving.
    order = [next(iter(s["scheduled"])) for s in steps]
    runs_of = [rid for i, rid in enumerate(order) if i == 0 or order[i - 1] != rid]
    assert sorted(runs_of) == sorted(set(runs_of)) and len(runs_of) == 6
    assert sum(len(s["finished"]) for s in steps) == 6


def test_static_never_admits_into_a_running_batch(runs):
    steps = runs["static"][1]
    running_after_previous = 0
    batches: list[set[str]] = []
    for s in steps:
        if s["admitted"]:
            assert running_after_previous == 0, f"step {s['step']} admitted into a running batch"
            batches.append(set(s["admitted"]))
        assert set(s["scheduled"]) <= batches[-1]
        running_after_previous = s["running"]
    # Up to --max-num-seqs together (how many form the first batch depends on when the six clients' requests land),
    # prompts whole despite the 32-token budget.
    assert 2 <= max(len(b) for b in batches) <= 4
    assert sum(len(b) for b in batches) == 6
    admitted_prefill = [n for s in steps for rid, n in s["scheduled"].items() if rid in s["admitted"]]
    assert max(admitted_prefill) > 32


def test_continuous_batches_requests_and_chunks_prompts(runs):
    steps = runs["continuous"][1]
    assert all(n <= 32 for s in steps for n in s["scheduled"].values())
    assert max(len(s["scheduled"]) for s in steps) > 1


def test_a_step_longer_than_the_lease_keeps_the_lease(redis_server, worker, tmp_path):  # noqa: F811
    """A static batch of four 1000-token prompts is prefilled in one step that outlasts the 500 ms lease on this
    CPU; the scheduler renews its lease while it waits on the worker instead of losing the pool mid-step."""
    log = tmp_path / "steps.jsonl"
    sched = cluster.start_scheduler(redis_server, worker, ["--scheduling-mode", "static", "--lease-ttl-ms", "500",
                                                           "--step-log", str(log)])
    try:
        cluster.wait_healthy(sched.address)
        stub = pb_grpc.LLMServeStub(grpc.insecure_channel(sched.address))
        out: dict[int, list] = {}

        def one(i: int) -> None:
            req = pb.GenerateRequest(request_id=f"long-{i}",
                                     token_ids=pb.TokenIds(ids=[(7 * j + i) % 900 + 20 for j in range(1000)]),
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            out[i] = list(stub.Generate(req, timeout=120))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(out) == [0, 1, 2, 3]
        for msgs in out.values():
            assert sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].finish_reason == "length"
        times = [t0] + [s["time"] for s in _steps(log)]
        longest = max(b - a for a, b in zip(times, times[1:], strict=False))
        assert longest > 0.5, "no step outlasted the lease; the test proves nothing"
        assert "lost its lease" not in sched.log_tail()
    finally:
        cluster.stop(sched)
