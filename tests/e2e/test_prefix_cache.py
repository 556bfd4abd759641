"""Prefix caching and parallel sampling end to end: redis-server, real workers and schedulers, real gRPC.

Two CPU workers serve the module (started in parallel): "main" (160 KV blocks of 16 tokens) and "small" (24 blocks,
so a few requests evict cached blocks and preempt each other). Every greedy output with prefix caching on must equal
the output with caching off: the references come from a scheduler started with `--no-enable-prefix-caching` in its
own namespace on the same worker, run before the caching one (a worker serves one scheduler at a time). Sampled
references (n = 4 with a seed) are single-sequence runs with seed + i. Every scheduler runs with
`--debug-invariants`; after every test, once idle, the ledger must hold no reference and free + evictable ==
total, and `vllm:prefix_cache_hits_total` (tokens) must have grown exactly where a hit is expected.

Prompts are token ids cut from natural text (each starts with its own header, so no two prompts share a block
unless a test means them to), so the outputs are real continuations that depend on every cached token.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import redis

from llmserve.bench.metrics import summed_metrics as metrics
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from scheduler_svc.core.block_pool import BlockPool, hash_block
from scheduler_svc.ledger.store import RedisLedger, StepCommit
from tests.support import cluster
from tests.support.waiting import wait_for

BS = 16
MAIN_BLOCKS = 160
SMALL_BLOCKS = 24
RPC_TIMEOUT_S = 180
LEASE_TTL_MS = 5000  # a step must commit within this (CPU steps on a busy 2-core box take seconds)
WORKER_ARGS = ["--device", "cpu", "--max-model-len", 512]
SCHEDULER_ARGS = ["--debug-invariants", "--lease-ttl-ms", LEASE_TTL_MS, "--max-num-batched-tokens", 256]
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"

CORPUS = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips after decades of "
    "salt wind. Every evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the "
    "lamp and wind the clockwork that turned the great lens. Ships passing in the night saw its beam sweep across "
    "the water every ten seconds, a steady signal that the rocks were near and the harbor lay to the north. In "
    "winter the storms came in from the west, and the keeper would sit by the stove in the small kitchen, "
    "listening to the waves break against the stones below and writing in the logbook the direction of the wind, "
    "the height of the sea and the names of the vessels that had gone by. The village at the foot of the hill "
    "depended on fishing, and most families had a father or a brother out on the boats. When the fog rolled in, "
    "the keeper sounded the horn as well, a low note that carried for miles. Children in the village learned to "
    "count the seconds between the flashes before they learned to read. A new road was built along the coast in "
    "the spring, and with it came engineers who measured the cliff and talked about an automatic light that "
    "would need no keeper at all. The keeper listened politely, offered them tea, and showed them the brass "
    "fittings he polished every Sunday. He knew that machines could turn a lens, but he doubted that a machine "
    "would notice a small boat in trouble, or walk down to the harbor in the rain to tell a worried mother that "
    "her son's lantern was still moving on the water. The engineers wrote their report and left, and for a few "
    "more years nothing changed. Then one autumn a letter arrived from the ministry, thanking him for his long "
    "service and announcing that the new light would be installed before the end of the year."
)
QUESTIONS = [
    " Question: How many stairs did the keeper climb each evening? Answer:",
    " Question: Which direction did the winter storms come from? Answer:",
    " Question: What did the children learn before they could read? Answer:",
    " Question: What did the engineers want to build? Answer:",
    " Question: What did the keeper polish every Sunday? Answer:",
    " Question: Why did the village depend on the sea? Answer:",
    " Question: What arrived from the ministry in the autumn? Answer:",
    " Question: What did the keeper write in the logbook? Answer:",
]


# ---- clients --------------------------------------------------------------------------------------------------


def request(prompt: list[int], max_tokens: int, *, n: int = 1, temperature: float = 0.0, seed: int | None = None,
            salt: str = "", rid: str = "", resume_from: int = 0) -> pb.GenerateRequest:
    s = pb.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, n=n)
    if seed is not None:
        s.seed = seed
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), sampling=s, cache_salt=salt,
                              resume_from_token=resume_from)


def generate(address: str, prompt: list[int], max_tokens: int, **kw) -> list[list[int]]:
    """Every sequence's output tokens (index i = sequence i); each must end with finish_reason length."""
    n = max(1, kw.get("n", 1))
    outs: list[list[int]] = [[] for _ in range(n)]
    finish = [""] * n
    with grpc.insecure_channel(address) as ch:
        for m in pb_grpc.LLMServeStub(ch).Generate(request(prompt, max_tokens, **kw), timeout=RPC_TIMEOUT_S):
            assert not finish[m.index], "a message after the final one"
            assert m.first_token_index == len(outs[m.index])
            outs[m.index] += m.token_ids
            finish[m.index] = m.finish_reason
    assert finish == ["length"] * n and all(len(o) == max_tokens for o in outs), (finish, [len(o) for o in outs])
    return outs


def concurrently(fns) -> list:
    barrier = threading.Barrier(len(fns))

    def wrap(fn):
        barrier.wait(timeout=30)
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns)) as ex:
        return [f.result(timeout=RPC_TIMEOUT_S * 2) for f in [ex.submit(wrap, fn) for fn in fns]]


@dataclass
class Stream:
    """One request followed to its end in a thread, re-attaching (resume_from_token) after UNAVAILABLE."""

    address: str
    prompt: list[int]
    max_tokens: int
    rid: str
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    sessions: int = 0
    errors: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while not self.finish and time.monotonic() < deadline:
            req = request(self.prompt, self.max_tokens, rid=self.rid, resume_from=len(self.tokens))
            try:
                with grpc.insecure_channel(self.address) as ch:
                    self.sessions += 1
                    for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=RPC_TIMEOUT_S):
                        if m.token_ids and m.first_token_index != len(self.tokens):
                            self.errors.append(f"first_token_index {m.first_token_index} after {len(self.tokens)}")
                        self.tokens += m.token_ids
                        self.finish = self.finish or m.finish_reason
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.errors.append(f"{e.code().name}: {e.details()}")
                    return
                time.sleep(0.2)

    def join(self) -> Stream:
        assert self.thread is not None
        self.thread.join(RPC_TIMEOUT_S)
        assert not self.thread.is_alive(), f"{self.rid} still streaming"
        assert not self.errors, (self.rid, self.errors)
        return self


# ---- the processes --------------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.procs: list[cluster.Proc] = []
        self.workers: dict[str, cluster.Proc] = {}
        self.current: dict[str, cluster.Proc] = {}  # worker name -> the scheduler driving it
        self.refs: dict[tuple, list[int]] = {}
        self.tok = None
        self.corpus: list[int] = []
        self.p: dict[str, list[int]] = {}

    def start(self) -> None:
        pending = {"main": cluster.start_worker([*WORKER_ARGS, "--num-gpu-blocks-override", MAIN_BLOCKS], wait=False),
                   "small": cluster.start_worker([*WORKER_ARGS, "--num-gpu-blocks-override", SMALL_BLOCKS,
                                                         "--allow-kv-pool-below-max-model-len"],
                                                 wait=False)}
        self.procs += pending.values()
        from common.tokenizer import Tokenizer
        from worker_svc.model.loader import default_model_path

        self.tok = Tokenizer.from_gguf(default_model_path())  # while the workers load
        self.corpus = self.tok.encode(CORPUS, add_special_tokens=False)
        for name, proc in pending.items():
            self.workers[name] = cluster.wait_ready(proc)

    def doc(self, tag: str, n: int, offset: int = 0) -> list[int]:
        """n tokens: a header naming `tag`, then the corpus from `offset` (so prompts never share a first block)."""
        ids = self.tok.encode(f"Document {tag}.\n", add_special_tokens=False) + self.corpus[offset:]
        assert len(ids) >= n, (tag, n, len(ids))
        return ids[:n]

    def question(self, i: int) -> list[int]:
        return self.tok.encode(QUESTIONS[i], add_special_tokens=False)

    def scheduler(self, worker: str, *, caching: bool = True, namespace: str | None = None, port: int | None = None,
                  wait: bool = True) -> cluster.Proc:
        """A scheduler on `worker` (stopping the one driving it now), with a metrics port."""
        prev = self.current.pop(worker, None)
        if prev is not None and prev.alive():
            cluster.stop(prev)
        mport = cluster.free_port()
        extra = [*SCHEDULER_ARGS, "--metrics-port", mport,
                 "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
        if port:
            extra += ["--port", port]
        proc = cluster.start_scheduler(self.redis_url, self.workers[worker], extra,
                                       namespace=namespace or cluster.new_namespace("pc-on" if caching else "pc-off"))
        proc.extra["metrics_port"] = mport
        proc.extra["worker"] = worker
        self.procs.append(proc)
        self.current[worker] = proc
        if wait:
            cluster.wait_healthy(proc.address, timeout=120, proc=proc)
        return proc

    def ledger(self, proc_or_ns) -> RedisLedger:
        ns = proc_or_ns if isinstance(proc_or_ns, str) else proc_or_ns.namespace
        return cluster.ledger(self.redis_url, ns)

    def on_main(self) -> cluster.Proc:
        """The module's caching scheduler on the main worker (started again if another took the worker)."""
        cur = self.current.get("main")
        if cur is None or not cur.alive() or cur.extra.get("role") != "on-main":
            cur = self.scheduler("main")
            cur.extra["role"] = "on-main"
        return cur

    def compute_refs(self, worker: str, specs: list[tuple]) -> None:
        """Run each spec (prompt, max_tokens, seed or None for greedy) on a caching-off scheduler, concurrently."""
        todo = [s for s in specs if (worker, *s) not in self.refs]
        if not todo:
            return
        off = self.scheduler(worker, caching=False)

        def one(spec):
            prompt, max_tokens, seed = spec
            kw = {} if seed is None else {"temperature": 0.8, "seed": seed}
            return generate(off.address, list(prompt), max_tokens, **kw)[0]

        for spec, out in zip(todo, concurrently([lambda s=s: one(s) for s in todo]), strict=True):
            self.refs[(worker, *spec)] = out
        assert_idle(self.ledger(off), total(worker))
        cluster.stop(off)
        self.current.pop(worker, None)

    def ref(self, worker: str, prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
        return self.refs[(worker, tuple(prompt), max_tokens, seed)]

    def shutdown(self) -> None:
        for kind in ("scheduler", "worker"):
            group = [p for p in self.procs if p.name.startswith(kind)]
            if group:
                with ThreadPoolExecutor(len(group)) as ex:
                    list(ex.map(cluster.stop, group))


def main_prompts(cl: Cluster) -> dict[str, list[int]]:
    """Every prompt the main-worker tests send, by name (their references are computed once, up front)."""
    p: dict[str, list[int]] = {}
    system, system2 = cl.doc("system-a", SYSTEM_LEN), cl.doc("system-b", SYSTEM2_LEN, offset=40)
    for i in range(4):
        p[f"sys-{i}"] = system + cl.question(i)
        p[f"sys2-{i}"] = system2 + cl.question(4 + i)
    for n in (128, 133):
        p[f"whole-{n}"] = cl.doc(f"whole-{n}", n, offset=100)
    shared = cl.doc("diverge", 40, offset=200)  # 2.5 blocks
    p["div-a"], p["div-b"] = shared + cl.question(0), shared + cl.question(1)
    p["div-c"] = shared[:37] + cl.question(2)  # diverges 3 tokens earlier, still inside block 2
    p["salted"] = cl.doc("salted", 90, offset=60)
    prefix = cl.doc("abort", 100, offset=150)
    for i in range(4):
        p[f"abort-{i}"] = prefix + cl.question(i)
    for n in (101, 96):
        p[f"n4-{n}"] = cl.doc(f"n4-{n}", n, offset=250)
    p["n4-abort"] = cl.doc("n4-abort", 77, offset=200)
    p["n4-sampled"] = cl.doc("n4-sampled", 70, offset=20)
    prefix = cl.doc("restart", 110, offset=120)
    for i in range(6):
        p[f"restart-{i}"] = prefix + cl.question(i)
    return p


SYSTEM_LEN, SYSTEM2_LEN = 130, 118  # the two shared system prompts
SAMPLED_SEED = 4242
N4_ABORT_LEN = 32  # sequence 2 is aborted after its third token: the others run on well past it
# (prompt name, max_tokens, seed or None for greedy)
MAIN_REFS = ([(f"sys-{i}", 12, None) for i in range(4)] + [(f"sys2-{i}", 12, None) for i in range(4)]
             + [("whole-128", 8, None), ("whole-133", 8, None), ("salted", 8, None)]
             + [(f"div-{x}", 10, None) for x in "abc"]
             + [("abort-0", 4, None)] + [(f"abort-{i}", 32, None) for i in (1, 2, 3)]
             + [("n4-101", 12, None), ("n4-96", 12, None), ("n4-abort", N4_ABORT_LEN, None)]
             + [("n4-sampled", 12, SAMPLED_SEED + i) for i in range(4)]
             + [(f"restart-{i}", 24, None) for i in range(6)])


def total(worker: str) -> int:
    return MAIN_BLOCKS if worker == "main" else SMALL_BLOCKS


def spec(prompt: list[int], max_tokens: int, seed: int | None = None) -> tuple:
    return (tuple(prompt), max_tokens, seed)


def assert_idle(ledger: RedisLedger, num_blocks: int, timeout: float = 30.0) -> dict:
    """Once idle: no active request, no reference, free + evictable == total, and every evictable block cached."""
    def idle():
        st = ledger.check_ledger()
        return st if st["active"] == 0 and st["allocated"] == 0 else None

    st = wait_for(f"an idle ledger in {ledger.prefix}", idle, timeout)
    assert st["refs_sum"] == 0 and st["overlap"] == 0, st
    assert st["free"] + st["evictable"] == st["total"] == num_blocks, st
    assert st["cached"] == st["evictable"], st  # idle: the hashed blocks are exactly the evictable ones
    return st


def assert_clean_log(proc: cluster.Proc) -> None:
    log = proc.log_text()
    for bad in ("Traceback", "INVARIANT", "engine iteration failed", "AssertionError"):
        assert bad not in log, f"{bad!r} in the log of {proc.describe()}:\n{proc.log_tail()}"


def expected_hit(prompt: list[int], cached_seqs: list[list[int]]) -> int:
    """Tokens a prompt hits given the token sequences whose full blocks are cached (nothing evicted)."""
    best = 0
    for seq in cached_seqs:
        k = 0
        while k < min(len(seq), len(prompt)) and seq[k] == prompt[k]:
            k += 1
        best = max(best, k // BS)
    return min(best, (len(prompt) - 1) // BS) * BS


class Hits:
    """Deltas of the prefix-cache counters on one scheduler."""

    def __init__(self, proc: cluster.Proc, fresh: bool = False):
        self.port = proc.extra["metrics_port"]
        self.last = {} if fresh else metrics(self.port)  # fresh: count from the process start

    def delta(self) -> tuple[int, int]:
        """(hit tokens, queried tokens) since the last call."""
        now = metrics(self.port)
        d = (int(now.get(HITS, 0) - self.last.get(HITS, 0)), int(now.get(QUERIES, 0) - self.last.get(QUERIES, 0)))
        self.last = now
        return d


@pytest.fixture(scope="module")
def cl(redis_server):  # noqa: F811
    c = Cluster(redis_server)
    try:
        c.start()
        c.p = main_prompts(c)
        c.compute_refs("main", [spec(c.p[name], m, seed) for name, m, seed in MAIN_REFS])
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def on(cl):
    """The main worker's caching scheduler; after the test its ledger must be idle and clean, its log too."""
    proc = cl.on_main()
    yield proc
    assert_idle(cl.ledger(proc), MAIN_BLOCKS)
    assert_clean_log(proc)


# ---- the ledger itself ----------------------------------------------------------------------------------------


def test_lru_order_and_index_survive_a_ledger_reload(redis_server):  # noqa: F811
    """The evictable LRU and the hash index go through Redis intact: a block freed after a reload is evicted after
    every block freed before it (the stored LRU ticks are continued, not renumbered)."""
    client = redis.Redis.from_url(redis_server)
    led = RedisLedger(client, namespace=cluster.new_namespace("pc-lru"))
    led.init_pool(8, 4)
    token = led.try_acquire_lease("h", 5000)
    step = 0

    def commit(pool: BlockPool) -> None:
        nonlocal step
        step += 1
        led.commit_step("h", token, 5000, StepCommit(step, 0, block_changes=pool.take_changes(),
                                                     check_invariant=True))

    def cache(pool: BlockPool, base: int) -> list[int]:
        toks = tuple(range(base, base + 4))
        (b,) = pool.allocate(1)
        pool.register(b, hash_block(None, toks), toks)
        pool.release([b])
        return [b]

    p = led.load().pool
    a, b = cache(p, 10), cache(p, 20)
    for _ in range(3):  # a is hit and freed again: its tick is now above the number of evictable blocks
        p.take(a)
        p.release(a)
    commit(p)
    p2 = led.load().pool
    assert list(p2.evictable) == b + a and p2.index == p.index
    c = cache(p2, 30)
    commit(p2)
    p3 = led.load().pool
    assert list(p3.evictable) == b + a + c, "the LRU order changed across a reload"
    assert p3.cached_prefix([hash_block(None, (30, 31, 32, 33))], [(30, 31, 32, 33)]) == c
    p3.allocate(5)  # the never-used blocks first
    assert p3.allocate(1) == b
    assert led.check_ledger()["cached"] == 3
    led.flush_pool()


# ---- caching on the main worker -------------------------------------------------------------------------------


def test_shared_system_prompt_sequential_then_concurrent(cl, on):
    hits = Hits(on)
    # One after another: each later request hits at least the system prompt's full blocks.
    cached: list[list[int]] = []
    for i in range(4):
        p = cl.p[f"sys-{i}"]
        out = generate(on.address, p, 12)[0]
        assert out == cl.ref("main", p, 12), f"request {i} differs with prefix caching"
        got, queried = hits.delta()
        want = expected_hit(p, cached)
        assert (got, queried) == (want, len(p)), (i, got, want)
        if i:
            assert got >= SYSTEM_LEN // BS * BS
        cached.append(p + out[:-1])

    # All at once on another system prompt: they race for the same blocks; outputs still identical.
    conc = [cl.p[f"sys2-{i}"] for i in range(4)]
    for p, out in zip(conc, concurrently([lambda p=p: generate(on.address, p, 12)[0] for p in conc]), strict=True):
        assert out == cl.ref("main", p, 12)
    # Once computed, the system prompt is shared: a repeat hits at least its full blocks.
    hits.delta()
    assert generate(on.address, conc[0], 12)[0] == cl.ref("main", conc[0], 12)
    assert hits.delta()[0] >= SYSTEM2_LEN // BS * BS


@pytest.mark.parametrize("length", [128, 133])
def test_entirely_cached_prompt_recomputes_only_its_last_block(cl, on, length):
    p = cl.p[f"whole-{length}"]
    hits = Hits(on)
    first = generate(on.address, p, 8)[0]
    assert hits.delta() == (0, length)
    second = generate(on.address, p, 8)[0]
    # At least one token is computed: a 128-token prompt takes 7 cached blocks, a 133-token one all 8 full ones.
    assert hits.delta() == ((length - 1) // BS * BS, length)
    assert first == second == cl.ref("main", p, 8)


def test_prompts_diverging_mid_block(cl, on):
    hits = Hits(on)
    prompts = [cl.p[f"div-{x}"] for x in "abc"]
    for x in prompts:
        assert generate(on.address, x, 10)[0] == cl.ref("main", x, 10)
    # b shares 40 tokens + " Question:" with a, c only 37: both hit the 2 full blocks before the divergence.
    assert hits.delta() == (0 + 32 + 32, sum(map(len, prompts)))


def test_cache_salt_never_hits_across_tenants(cl, on):
    p = cl.p["salted"]
    ref = cl.ref("main", p, 8)
    hits = Hits(on)
    assert generate(on.address, p, 8, salt="tenant-a")[0] == ref
    assert hits.delta() == (0, len(p))
    for salt in ("tenant-b", "", "tenant-a "):
        assert generate(on.address, p, 8, salt=salt)[0] == ref
        assert hits.delta()[0] == 0, f"salt {salt!r} hit blocks cached under 'tenant-a'"
    assert generate(on.address, p, 8, salt="tenant-a")[0] == ref
    assert hits.delta()[0] == (len(p) - 1) // BS * BS


def test_abort_one_of_the_sharers(cl, on):
    prompts = [cl.p[f"abort-{i}"] for i in range(4)]
    prefix_blocks = 100 // BS
    led = cl.ledger(on)
    hits = Hits(on)
    assert generate(on.address, prompts[0], 4)[0] == cl.ref("main", prompts[0], 4)  # warms the prefix
    hits.delta()
    tag = uuid.uuid4().hex[:6]
    streams = [Stream(on.address, p, 32, f"ab-{tag}-{i}").start() for i, p in enumerate(prompts[1:])]
    victim = streams[1]
    wait_for("the victim's third token",
             lambda: (r := led.get_request(victim.rid)) is not None and len(r.output_ids) >= 3)
    with grpc.insecure_channel(on.address) as ch:
        assert pb_grpc.LLMServeStub(ch).Abort(pb.AbortRequest(request_id=victim.rid), timeout=30).found
    for s in streams:
        s.join()
    assert victim.finish == "abort" and 3 <= len(victim.tokens) < 32
    assert victim.tokens == cl.ref("main", victim.prompt, 32)[: len(victim.tokens)]
    for s in (streams[0], streams[2]):
        assert s.finish == "length" and s.tokens == cl.ref("main", s.prompt, 32), s.rid
    assert hits.delta()[0] >= 3 * prefix_blocks * BS, "each sharer should hit the warmed prefix"


@pytest.mark.parametrize("length", [101, 96])
def test_n4_greedy_equals_the_single_output(cl, on, length):
    p = cl.p[f"n4-{length}"]
    assert generate(on.address, p, 12, n=4) == [cl.ref("main", p, 12)] * 4


def test_n4_greedy_with_one_sequence_aborted(cl, on):
    p = cl.p["n4-abort"]
    led = cl.ledger(on)
    rid = f"n4ab-{uuid.uuid4().hex[:6]}"
    outs: list[list[int]] = [[] for _ in range(4)]
    finish = [""] * 4

    def run():
        with grpc.insecure_channel(on.address) as ch:
            for m in pb_grpc.LLMServeStub(ch).Generate(request(p, N4_ABORT_LEN, n=4, rid=rid), timeout=RPC_TIMEOUT_S):
                outs[m.index] += m.token_ids
                finish[m.index] = m.finish_reason

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for("sequence 2's third token",
             lambda: (r := led.get_request(f"{rid}#2")) is not None and len(r.output_ids) >= 3)
    with grpc.insecure_channel(on.address) as ch:
        assert pb_grpc.LLMServeStub(ch).Abort(pb.AbortRequest(request_id=f"{rid}#2"), timeout=30).found
    t.join(RPC_TIMEOUT_S)
    ref = cl.ref("main", p, N4_ABORT_LEN)
    assert finish == ["length", "length", "abort", "length"]
    assert outs[0] == outs[1] == outs[3] == ref
    assert 3 <= len(outs[2]) < N4_ABORT_LEN and outs[2] == ref[: len(outs[2])]


def test_n4_sampled_sequence_i_equals_a_single_run_with_seed_plus_i(cl, on):
    p = cl.p["n4-sampled"]
    outs = generate(on.address, p, 12, n=4, temperature=0.8, seed=SAMPLED_SEED)
    for i, out in enumerate(outs):
        assert out == cl.ref("main", p, 12, SAMPLED_SEED + i), f"sequence {i} differs from the run with seed + {i}"
    assert len({tuple(o) for o in outs}) > 1, "seeds seed + i must give different samples"


# ---- scheduler restart ----------------------------------------------------------------------------------------


def describe_worker(address: str) -> wpb.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        return wpb_grpc.WorkerStub(ch).Describe(wpb.DescribeRequest(), timeout=30)


def test_scheduler_kill9_mid_generation_and_idle_restarts_keep_outputs_and_the_index(cl):
    prompts = [cl.p[f"restart-{i}"] for i in range(6)]
    prefix_tokens = 110 // BS * BS
    ns, port = cluster.new_namespace("pc-restart"), cluster.free_port()
    led = cl.ledger(ns)
    first = cl.scheduler("main", namespace=ns, port=port)
    assert generate(first.address, prompts[0], 24)[0] == cl.ref("main", prompts[0], 24)  # warm

    tag = uuid.uuid4().hex[:6]
    streams = [Stream(first.address, p, 24, f"rs-{tag}-{i}").start() for i, p in enumerate(prompts[1:4])]
    wait_for("two committed tokens in every stream", lambda: all(
        (r := led.get_request(s.rid)) is not None and len(r.output_ids) >= 2 for s in streams))
    cluster.kill(first)
    assert all(len(led.get_request(s.rid).output_ids) < 24 for s in streams), "not mid-generation"
    # Did the killed leader leave a step the worker ran but Redis never saw? (Then every hash must go.)
    worker_step = describe_worker(cl.workers["main"].address).last_step_id
    in_flight = worker_step != int(led.client.hget(led.k_meta, "step_id"))
    assert led.check_ledger()["cached"] > 0

    second = cl.scheduler("main", namespace=ns, port=port)
    hits = Hits(second, fresh=True)
    for s in streams:
        s.join()
        assert s.finish == "length" and s.tokens == cl.ref("main", s.prompt, 24), s.rid
        assert s.sessions >= 2, f"{s.rid} never re-attached"
    resumed_hits, _ = hits.delta()
    if not in_flight:
        # The index survived the kill: the resumed requests recompute only what the cache lacks.
        assert resumed_hits >= 3 * prefix_tokens, resumed_hits
    assert generate(second.address, prompts[4], 24)[0] == cl.ref("main", prompts[4], 24)
    assert hits.delta()[0] >= prefix_tokens, "no hit after the restart"
    assert_idle(led, MAIN_BLOCKS)
    assert_clean_log(second)

    # Two more restarts with no traffic between them (kill -9 while idle): the index must still be there.
    for _ in range(2):
        cluster.kill(cl.current.pop("main"))
        cl.scheduler("main", namespace=ns, port=port)
    last = cl.current["main"]
    hits = Hits(last, fresh=True)
    assert generate(last.address, prompts[5], 24)[0] == cl.ref("main", prompts[5], 24)
    assert hits.delta()[0] == expected_hit(prompts[5], prompts[:5]), "the prefix cache did not survive idle restarts"
    assert_idle(led, MAIN_BLOCKS)
    assert_clean_log(last)
    print(f"\nrestart: step in flight at the kill: {in_flight}; hits after resuming: {resumed_hits} tokens")


# ---- a small pool: eviction and preemption -------------------------------------------------------------------


def test_eviction_and_preemption_of_sharers_under_a_small_pool(cl):
    """24 blocks. Eviction: five 88-token prompts (80-token documents + a question of 8), run one after another,
    each leave 5 full blocks cached; the fifth evicts the least recently used, the first document's deepest blocks
    (released tail first), so its second question hits only its first 3 blocks, while the fourth document, more
    recent, hits all 5. Preemption: four requests sharing a 64-token prefix need 4 + 4 x 6 blocks."""
    q = [cl.question(i)[:8] for i in range(8)]
    assert all(len(x) == 8 for x in q)
    docs = [cl.doc(f"evict-{k}", 80, offset=30 * k) for k in range(5)]
    seq = [docs[k] + q[0] for k in range(5)] + [docs[0] + q[1], docs[3] + q[1]]
    shared = cl.doc("preempt", 64, offset=10)
    warm = shared + q[2]
    conc = [shared + q[3 + i] for i in range(4)]

    # References without caching, on the same worker; sequential ones one by one (as with caching below).
    off = cl.scheduler("small", caching=False)
    for p in seq:
        cl.refs[("small", *spec(p, 8))] = generate(off.address, p, 8)[0]
    cl.refs[("small", *spec(warm, 4))] = generate(off.address, warm, 4)[0]
    for p, out in zip(conc, concurrently([lambda p=p: generate(off.address, p, 80)[0] for p in conc]), strict=True):
        cl.refs[("small", *spec(p, 80))] = out
    assert_idle(cl.ledger(off), SMALL_BLOCKS)

    on = cl.scheduler("small")
    led = cl.ledger(on)
    hits = Hits(on)
    got = []
    for p in seq:
        assert generate(on.address, p, 8)[0] == cl.ref("small", p, 8)
        got.append(hits.delta()[0])
    assert got == [0, 0, 0, 0, 0, 48, 80], got
    st = assert_idle(led, SMALL_BLOCKS)
    assert st["evictable"] > 0

    assert generate(on.address, warm, 4)[0] == cl.ref("small", warm, 4)
    before = metrics(on.extra["metrics_port"])
    outs = concurrently([lambda p=p: generate(on.address, p, 80)[0] for p in conc])
    for i, (p, out) in enumerate(zip(conc, outs, strict=True)):
        assert out == cl.ref("small", p, 80), f"sharer {i} differs"
    after = metrics(on.extra["metrics_port"])
    preemptions = after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    assert preemptions > 0, "the four sharers were meant to run the pool dry"
    assert after[HITS] - before.get(HITS, 0) >= 4 * 64
    assert_idle(led, SMALL_BLOCKS)
    assert_clean_log(on)
    print(f"\nsmall pool: {preemptions:.0f} preemptions among the sharers")
