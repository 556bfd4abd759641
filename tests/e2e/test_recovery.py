"""Recovery with real processes and SIGKILL: the scheduler, the worker, a leader with a standby, fencing.

One worker (CPU, fixed port so a restarted worker keeps the scheduler's --worker-address valid) and one
redis-server serve the module. REQUESTS (three greedy, one sampled at temperature 0.8 with a fixed seed, all
`ignore_eos`, 48 tokens, client-chosen ids) are first run uninterrupted on their own scheduler and namespace:
that is the reference every interrupted run must equal token for token. Each test then uses a fresh namespace
(so a fresh pool, lease and fencing counter) on the same worker, kills (SIGKILL) or freezes (SIGSTOP) a process
mid-generation, and checks that clients -- re-attaching by request id with `resume_from_token` where their
stream broke -- end with exactly the reference tokens, and that the Redis ledger ends clean. One request asks for
logprobs and its client re-attaches from token 0, so every token the ledger held is sent again by the new leader:
each comes with the logprobs the first leader sent for it (stored in the ledger beside the tokens). Fencing is also
checked by hand: plans with an older token are refused by the worker, and a leader whose pool's counter is
behind the worker's token moves past it.

Progress ("mid-generation") is read from Redis, the source of truth: a request counts as started once its
committed output has MIN_PROGRESS tokens, and it must still be unfinished when the process is killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import grpc
import pytest

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.support import cluster
from tests.support.waiting import wait_for

MAX_TOKENS = 48
LEASE_TTL_MS = 1500
MIN_PROGRESS = 4  # committed tokens every request has before the kill
TAKEOVER_LIMIT_S = 10.0  # a standby leads about one lease TTL after the leader's SIGKILL (waits allow more)
RUN_TIMEOUT_S = 180.0
WORKER_ARGS = ["--device", "cpu", "--num-gpu-blocks-override", 256, "--max-model-len", 512]
SCHEDULER_ARGS = ["--lease-ttl-ms", LEASE_TTL_MS, "--debug-invariants"]
SPEC = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')

TOP_LOGPROBS = 3
# name -> (prompt text, extra sampling fields); every request is also max_tokens=MAX_TOKENS, ignore_eos.
REQUESTS = {
    "greedy-a": ("The capital of France is", {"temperature": 0.0}),
    "greedy-b": ("Once upon a time, in a small village,", {"temperature": 0.0}),
    "greedy-c": ("def fibonacci(n):", {"temperature": 0.0, "logprobs": TOP_LOGPROBS}),
    "sampled": ("The weather today is", {"temperature": 0.8, "seed": 1234}),
}
# Run through `llmserve generate --json` (greedy) in the scheduler-kill test.
CLI_PROMPT = "In a hole in the ground there lived a hobbit."
CLI_NAME = "cli"


def make_request(name: str, rid: str) -> pb.GenerateRequest:
    text, sampling = REQUESTS[name] if name != CLI_NAME else (CLI_PROMPT, {"temperature": 0.0})
    s = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    return pb.GenerateRequest(request_id=rid, text=text, sampling=s)


# ---- a client that re-attaches -------------------------------------------------------------------------------


@dataclass
class Stream:
    """One request followed to its end across scheduler failures, the way a client should do it."""

    name: str
    rid: str
    addresses: list[str]  # tried in turn after each UNAVAILABLE (a leader and its standby)
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    sessions: int = 0  # Generate calls that delivered at least one message
    unavailable: int = 0
    problems: list[str] = field(default_factory=list)  # anything that is not a clean UNAVAILABLE + re-attach
    timeout: float = RUN_TIMEOUT_S
    thread: threading.Thread | None = None
    # A request that asked for logprobs: (logprob, sorted top (token id, logprob)) per token. Its client
    # re-attaches from token 0 (as one that lost what it had would), keeping each session's list.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    sessions_logprobs: list[list] = field(default_factory=list)

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, name=f"client-{self.rid}", daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float = RUN_TIMEOUT_S) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.rid}: still streaming after {timeout:.0f}s ({len(self.tokens)})"

    def _run(self) -> None:
        req = make_request(self.name, self.rid)
        deadline = time.monotonic() + self.timeout
        turn = 0
        from_zero = req.sampling.HasField("logprobs")
        while not self.finish and time.monotonic() < deadline:
            if from_zero and self.tokens:
                self.sessions_logprobs.append(self.logprobs)
                self.tokens, self.logprobs = [], []
            req.resume_from_token = len(self.tokens)
            got_message = False
            try:
                with grpc.insecure_channel(self.addresses[turn % len(self.addresses)]) as channel:
                    for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=self.timeout):
                        if not got_message:
                            got_message = True
                            self.sessions += 1
                        if msg.token_ids and msg.first_token_index != len(self.tokens):
                            self.problems.append(f"first_token_index {msg.first_token_index} after "
                                                 f"{len(self.tokens)} tokens")
                        self.tokens.extend(msg.token_ids)
                        if from_zero:
                            got = [(lp.logprob, sorted((t.token_id, t.logprob) for t in lp.top))
                                   for lp in msg.logprobs]
                            self.logprobs += got + [None] * (len(msg.token_ids) - len(got))
                        if msg.finish_reason:
                            self.finish = msg.finish_reason
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.problems.append(f"{e.code().name}: {e.details()}")
                    return
                self.unavailable += 1
                turn += 1
                time.sleep(0.2)
        if not self.finish:
            self.problems.append(f"no final message within {self.timeout:.0f}s ({self.unavailable} x UNAVAILABLE)")


def start_streams(names, addresses: list[str], tag: str, timeout: float = RUN_TIMEOUT_S) -> dict[str, Stream]:
    return {n: Stream(n, f"{tag}-{n}-{uuid.uuid4().hex[:6]}", addresses, timeout=timeout).start() for n in names}


# ---- module processes ----------------------------------------------------------------------------------------


class Pool:
    """The module's worker (restartable on its fixed port), the redis URL, and every process started here."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.worker_port = cluster.free_port()
        self.procs: list[cluster.Proc] = []
        self.worker = self.start_worker()
        self.reference: dict[str, list[int]] = {}
        self.reference_logprobs: dict[str, list] = {}  # the requests that ask for logprobs

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    def start_worker(self) -> cluster.Proc:
        proc = cluster.start_worker([*WORKER_ARGS, "--port", self.worker_port])
        assert proc.port == self.worker_port
        self.procs.append(proc)
        return proc

    def scheduler(self, namespace: str, port: int | None = None, wait_serving: bool = True,
                  flags: tuple = ()) -> cluster.Proc:
        extra = [*SCHEDULER_ARGS, *flags] + (["--port", port] if port else [])
        proc = cluster.start_scheduler(self.redis_url, self.worker_address, extra, namespace=namespace)
        self.procs.append(proc)
        if wait_serving:
            cluster.wait_healthy(proc.address, timeout=120, proc=proc)
        return proc

    def ledger(self, namespace: str):
        return cluster.ledger(self.redis_url, namespace)

    def describe_worker(self) -> wpb.WorkerInfo:
        with grpc.insecure_channel(self.worker_address) as channel:
            return wpb_grpc.WorkerStub(channel).Describe(wpb.DescribeRequest(), timeout=30)

    def shutdown(self) -> None:
        for proc in sorted(self.procs, key=lambda p: not p.name.startswith("scheduler")):
            cluster.stop(proc)


@pytest.fixture(scope="module")
def pool(redis_server):  # noqa: F811
    p = Pool(redis_server)
    try:
        # The reference: every request (and the CLI's prompt) uninterrupted, on its own namespace.
        ref = p.scheduler(cluster.new_namespace("rec-ref"))
        streams = start_streams([*REQUESTS, CLI_NAME], [ref.address], "ref")
        for s in streams.values():
            s.join()
            assert not s.problems and s.sessions == 1, (s.rid, s.problems, s.sessions)
            assert s.finish == "length" and len(s.tokens) == MAX_TOKENS, (s.rid, s.finish, len(s.tokens))
            p.reference[s.name] = s.tokens
            if s.logprobs:
                assert None not in s.logprobs, s.rid
                p.reference_logprobs[s.name] = s.logprobs
        cluster.stop(ref)
        yield p
    finally:
        p.shutdown()


# ---- checks --------------------------------------------------------------------------------------------------


def committed(ledger, rids: list[str]) -> dict[str, int]:
    """Output tokens committed in Redis per request id (-1: not there yet)."""
    out = {}
    for rid in rids:
        req = ledger.get_request(rid)
        out[rid] = -1 if req is None else len(req.output_ids)
    return out


def wait_mid_generation(ledger, rids: list[str]) -> dict[str, int]:
    """Until every request has MIN_PROGRESS committed tokens; they must all still be unfinished."""
    def progressed():
        counts = committed(ledger, rids)
        return counts if min(counts.values()) >= MIN_PROGRESS else None

    counts = wait_for(f"{MIN_PROGRESS} committed tokens in each of {rids}", progressed)
    assert max(counts.values()) < MAX_TOKENS, f"a request finished before the kill; not mid-generation: {counts}"
    return counts


def assert_unfinished_in_redis(ledger, rids: list[str]) -> None:
    active = {x.decode() for x in ledger.client.smembers(ledger.k_active)}
    assert set(rids) <= active, f"requests missing from the active set after the kill: {set(rids) - active}"


def assert_ledger_clean(ledger, expected: dict[str, list[int]]) -> None:
    """Once idle: every block free, no active request, and Redis holds each reference output as finished."""
    def idle():
        state = ledger.check_ledger()
        idle = state["free"] + state["evictable"] == state["total"] and not state["active"]
        return state if idle else None

    state = wait_for("an idle ledger", idle, timeout=30)
    assert state["allocated"] == 0 and state["overlap"] == 0 and state["total"] == 256, state
    for rid, tokens in expected.items():
        req = ledger.get_request(rid)
        assert req is not None and req.finish_reason == "length", (rid, req)
        assert req.output_ids == tokens, f"{rid}: Redis output differs from the reference"
        assert req.block_ids == [], (rid, req.block_ids)


def assert_streams_equal_reference(pool: Pool, streams: dict[str, Stream]) -> None:
    for s in streams.values():
        s.join()
    for s in streams.values():
        assert not s.problems, (s.rid, s.problems)
        assert s.finish == "length", (s.rid, s.finish)
        ref = pool.reference[s.name]
        first_diff = next((i for i, (a, b) in enumerate(zip(s.tokens, ref, strict=False)) if a != b), None)
        assert s.tokens == ref, (f"{s.rid}: output differs from the uninterrupted run (first difference at "
                                 f"{first_diff}, {len(s.tokens)} tokens, {s.sessions} sessions)")
        if s.name in pool.reference_logprobs:
            assert_logprobs_as_undisturbed(s, pool.reference_logprobs[s.name])


def assert_logprobs_as_undisturbed(s: Stream, reference: list) -> None:
    """Every token of the last session (re-attached from token 0) has logprobs: those the ledger held are the
    values an earlier session got for the same token, bit for bit; all of them equal the uninterrupted run's up to
    the rounding of a different batch (the top tokens compared as sorted (id, logprob) pairs: near-ties may swap)."""
    empty = [i for i, lp in enumerate(s.logprobs) if lp is None or len(lp[1]) != TOP_LOGPROBS]
    assert not empty, f"{s.rid}: tokens {empty} came without logprobs ({s.sessions} sessions)"
    for earlier in s.sessions_logprobs:
        assert s.logprobs[:len(earlier)] == earlier, f"{s.rid}: a re-sent token's logprobs changed"
    for i, ((lp, top), (want_lp, want_top)) in enumerate(zip(s.logprobs, reference, strict=True)):
        assert lp == pytest.approx(want_lp, abs=1e-3), (s.rid, i, lp, want_lp)
        assert [p for _, p in top] == pytest.approx([p for _, p in want_top], abs=1e-3), (s.rid, i, top, want_top)


def lease_token(ledger) -> int:
    value = ledger.client.get(ledger.k_lease)
    assert value is not None, "no lease in Redis"
    return int(value.decode().rsplit(":", 1)[1])


# ---- tests ---------------------------------------------------------------------------------------------------


def test_scheduler_sigkill_clients_reattach_and_lose_nothing(pool):
    ns = cluster.new_namespace("rec-sched")
    port = cluster.free_port()  # the new scheduler listens where the old one did: clients keep their address
    first = pool.scheduler(ns, port)
    ledger = pool.ledger(ns)
    cli_rid = f"sk-cli-{uuid.uuid4().hex[:6]}"
    cli = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "generate", "--server", first.address, "--json", "--request-id", cli_rid,
         "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0", CLI_PROMPT],
        cwd=cluster.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The CLI's interpreter takes seconds to start on a loaded box: the in-process streams start once its
        # request is in, or they could all finish before it has MIN_PROGRESS tokens.
        wait_for("the CLI's request in Redis", lambda: committed(ledger, [cli_rid])[cli_rid] >= 0, timeout=120)
        streams = start_streams(REQUESTS, [first.address], "sk")
        rids = [s.rid for s in streams.values()] + [cli_rid]
        before = wait_mid_generation(ledger, rids)
        cluster.kill(first)
        t_kill = time.monotonic()
        assert_unfinished_in_redis(ledger, rids)
        old_token = lease_token(ledger)

        second = pool.scheduler(ns, port)
        takeover = time.monotonic() - t_kill
        assert second.port == port
        assert lease_token(ledger) > old_token, "the new leader must hold a newer fencing token"
        assert_streams_equal_reference(pool, streams)
        for s in streams.values():
            assert s.sessions >= 2 and s.unavailable >= 1, f"{s.rid} never re-attached ({s.sessions} sessions)"
        resent = streams["greedy-c"].sessions_logprobs
        assert resent and len(resent[0]) >= 1, "the logprobs request re-sent no token after the re-attach"

        out, err = cli.communicate(timeout=RUN_TIMEOUT_S)
        assert cli.returncode == 0, f"llmserve generate failed ({cli.returncode}): {err[-2000:]}"
        lines = [json.loads(line) for line in out.splitlines() if line.strip()]
        final = lines[-1]
        assert final["request_id"] == cli_rid and final["finish_reason"] == "length", final
        assert final["token_ids"] == pool.reference[CLI_NAME], "llmserve generate: output differs from the reference"
        assert final["usage"] == {"prompt_tokens": final["usage"]["prompt_tokens"], "completion_tokens": MAX_TOKENS}
        # Its streamed messages add up to the final list: no token twice, none lost across the re-attach.
        assert [t for m in lines[:-1] for t in m["token_ids"]] == final["token_ids"]

        expected = {s.rid: pool.reference[s.name] for s in streams.values()} | {cli_rid: pool.reference[CLI_NAME]}
        assert_ledger_clean(ledger, expected)
        print(f"\nscheduler SIGKILL at committed tokens {sorted(before.values())}; "
              f"replacement serving {takeover:.1f}s after the kill (process start included)")
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


@pytest.mark.slow  # kill -9 x speculation: each is in the default run alone (the plain kill -9s, test_speculative.py)
def test_scheduler_sigkill_mid_speculation_loses_nothing(pool):
    """Speculative decoding on (the replacement too): drafts are verified in flight when the scheduler dies; the
    clients re-attach and end with the reference tokens of the non-speculative run (greedy and seeded)."""
    ns = cluster.new_namespace("rec-spec")
    port, metrics_port = cluster.free_port(), cluster.free_port()
    first = pool.scheduler(ns, port, flags=SPEC)
    ledger = pool.ledger(ns)
    streams = start_streams(REQUESTS, [first.address], "spk")
    rids = [s.rid for s in streams.values()]
    wait_mid_generation(ledger, rids)
    cluster.kill(first)
    assert_unfinished_in_redis(ledger, rids)
    pool.scheduler(ns, port, flags=(*SPEC, "--metrics-port", metrics_port))
    assert_streams_equal_reference(pool, streams)
    for s in streams.values():
        assert s.sessions >= 2, f"{s.rid} never re-attached ({s.sessions} sessions)"
    assert_ledger_clean(ledger, {s.rid: pool.reference[s.name] for s in streams.values()})
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    drafts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert sum(drafts) > 0, "the replacement scheduler verified no drafts"


@pytest.mark.parametrize("flags", [(), pytest.param(SPEC, marks=pytest.mark.slow)], ids=["plain", "speculative"])
def test_worker_sigkill_and_restart_resumes_by_recompute(pool, flags):
    """With speculative decoding on, the worker dies with drafts in flight; the recompute proposes them again."""
    ns = cluster.new_namespace("rec-worker")
    sched = pool.scheduler(ns, flags=flags)
    ledger = pool.ledger(ns)
    old_epoch = pool.worker.epoch
    assert ledger.client.hget(ledger.k_meta, "worker_epoch").decode() == old_epoch
    streams = start_streams(REQUESTS, [sched.address], "wk")
    rids = [s.rid for s in streams.values()]
    before = wait_mid_generation(ledger, rids)
    cluster.kill(pool.worker)
    t_kill = time.monotonic()

    # The scheduler notices at its next step and reports it: NOT_SERVING, and new work is refused meanwhile.
    wait_for("NOT_SERVING after the worker died", lambda: cluster.health(sched.address) == "NOT_SERVING", timeout=30)
    with grpc.insecure_channel(sched.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.LLMServeStub(channel).Generate(make_request("greedy-a", "wk-refused"), timeout=30))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    assert_unfinished_in_redis(ledger, rids)

    pool.worker = pool.start_worker()  # same port, new process: new epoch, empty KV
    assert pool.worker.epoch != old_epoch
    cluster.wait_healthy(sched.address, timeout=60, proc=sched)
    recovered = time.monotonic() - t_kill
    assert ledger.client.hget(ledger.k_meta, "worker_epoch").decode() == pool.worker.epoch

    assert_streams_equal_reference(pool, streams)
    for s in streams.values():
        # Only the worker died: the scheduler kept every client stream open.
        assert s.sessions == 1 and s.unavailable == 0, (s.rid, s.sessions, s.unavailable)
    assert_ledger_clean(ledger, {s.rid: pool.reference[s.name] for s in streams.values()})
    assert sched.alive()
    print(f"\nworker SIGKILL at committed tokens {sorted(before.values())}; scheduler serving again "
          f"{recovered:.1f}s after the kill (worker start included)")


def test_standby_takes_over_when_the_leader_is_killed(pool):
    ns = cluster.new_namespace("rec-standby")
    leader = pool.scheduler(ns)
    ledger = pool.ledger(ns)
    leader_token = lease_token(ledger)
    standby = pool.scheduler(ns, wait_serving=False)
    # The standby stays out of the way for several lease lifetimes: NOT_SERVING, and Generate is UNAVAILABLE.
    time.sleep(2 * LEASE_TTL_MS / 1000)
    assert cluster.health(standby.address) == "NOT_SERVING"
    assert cluster.health(leader.address) == "SERVING"
    with grpc.insecure_channel(standby.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.LLMServeStub(channel).Generate(make_request("greedy-a", "sb-refused"), timeout=30))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    assert lease_token(ledger) == leader_token

    streams = start_streams(REQUESTS, [leader.address, standby.address], "sb")
    rids = [s.rid for s in streams.values()]
    wait_mid_generation(ledger, rids)
    assert pool.describe_worker().fencing_token == leader_token
    cluster.kill(leader)
    t_kill = time.monotonic()
    wait_for("the standby to serve", lambda: cluster.health(standby.address, timeout=1) == "SERVING",
             timeout=TAKEOVER_LIMIT_S + 20, interval=0.05)
    takeover = time.monotonic() - t_kill  # printed, not asserted: the wait above only guards against a hang
    new_token = lease_token(ledger)
    assert new_token > leader_token

    # Once the new leader has driven the worker, a plan from the old leader (its token, even one that would
    # reset the batch) is refused, and the new leader's requests carry on unharmed.
    wait_for("a step by the new leader", lambda: pool.describe_worker().fencing_token == new_token, timeout=30)
    info = pool.describe_worker()
    stale = wpb.StepPlan(step_id=info.last_step_id + 1, fencing_token=leader_token, expected_epoch=info.epoch,
                         reset_batch=True)
    with grpc.insecure_channel(pool.worker_address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            wpb_grpc.WorkerStub(channel).ExecuteStep(stale, timeout=30)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.value
    assert "fencing_token" in exc.value.details()

    assert_streams_equal_reference(pool, streams)
    for s in streams.values():
        assert s.sessions >= 2, f"{s.rid} never re-attached to the new leader"
    assert_ledger_clean(ledger, {s.rid: pool.reference[s.name] for s in streams.values()})
    print(f"\nstandby serving {takeover:.2f}s after the leader's SIGKILL (lease TTL {LEASE_TTL_MS} ms)")


def test_paused_old_leader_is_fenced_off(pool):
    """A leader frozen (SIGSTOP) long enough to lose its lease comes back believing it leads: whatever it does
    next -- a plan to the worker, a commit, a renewal -- is refused, it stands by, and the new leader's clients
    finish unharmed. Then a plan with an older fencing token, sent by hand, is rejected and changes nothing."""
    ns = cluster.new_namespace("rec-fence")
    old = pool.scheduler(ns)
    ledger = pool.ledger(ns)
    old_token = lease_token(ledger)
    new = pool.scheduler(ns, wait_serving=False)
    streams = start_streams(REQUESTS, [old.address, new.address], "zb")
    wait_mid_generation(ledger, [s.rid for s in streams.values()])
    old.popen.send_signal(signal.SIGSTOP)
    try:
        wait_for("the standby to serve", lambda: cluster.health(new.address, timeout=1) == "SERVING",
                 timeout=TAKEOVER_LIMIT_S + 20, interval=0.05)
        new_token = lease_token(ledger)
        assert new_token > old_token
        wait_for("a step by the new leader", lambda: pool.describe_worker().fencing_token == new_token, timeout=30)
    finally:
        old.popen.send_signal(signal.SIGCONT)
    wait_for("the old leader to stand by", lambda: cluster.health(old.address, timeout=1) == "NOT_SERVING",
             timeout=30, interval=0.05)
    assert_streams_equal_reference(pool, streams)
    assert old.alive() and cluster.health(old.address) == "NOT_SERVING"
    assert cluster.health(new.address) == "SERVING" and lease_token(ledger) == new_token
    assert_ledger_clean(ledger, {s.rid: pool.reference[s.name] for s in streams.values()})

    # By hand: the current token from Redis, and a plan one older (that would also wipe the batch).
    fence = int(ledger.client.get(f"{ns}:{{0}}:fence"))
    before = pool.describe_worker()
    assert before.fencing_token == fence == new_token
    plan = wpb.StepPlan(step_id=before.last_step_id + 1, fencing_token=fence - 1, expected_epoch=before.epoch,
                        reset_batch=True)
    plan.new_requests.add(request_id="fenced", prompt_token_ids=[1, 2, 3], num_scheduled_tokens=3, block_ids=[0],
                          sampling=wpb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(pool.worker_address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            wpb_grpc.WorkerStub(channel).ExecuteStep(plan, timeout=30)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.value
    assert f"fencing_token {fence - 1} is older than {fence}" in exc.value.details(), exc.value.details()
    after = pool.describe_worker()
    assert (after.last_step_id, after.fencing_token) == (before.last_step_id, before.fencing_token), \
        "a rejected plan must change nothing on the worker"


def test_leader_moves_past_a_worker_fence_its_pool_never_issued(pool):
    """A pool's fencing counter can be behind the token its worker last accepted: Redis lost the pool (flushed,
    or restarted without persistence) while the worker lived on, or the worker served another pool. The next
    leader must take a token above the worker's, not have every plan rejected (then step down, retake the lease
    with the same token, and retry forever)."""
    info = pool.describe_worker()
    floor = info.fencing_token + 5
    with grpc.insecure_channel(pool.worker_address) as channel:  # someone else drove the worker with `floor`
        wpb_grpc.WorkerStub(channel).ExecuteStep(
            wpb.StepPlan(step_id=info.last_step_id + 1, fencing_token=floor, expected_epoch=info.epoch), timeout=30)
    assert pool.describe_worker().fencing_token == floor

    ns = cluster.new_namespace("rec-fresh")
    sched = pool.scheduler(ns)
    ledger = pool.ledger(ns)
    stream = start_streams(["greedy-b"], [sched.address], "fresh", timeout=60)["greedy-b"]
    stream.join()
    assert not stream.problems and stream.tokens == pool.reference["greedy-b"], stream.problems
    assert stream.sessions == 1 and stream.unavailable == 0
    assert lease_token(ledger) > floor
    assert pool.describe_worker().fencing_token == lease_token(ledger)
    assert_ledger_clean(ledger, {stream.rid: stream.tokens})
