"""The scheduler end to end, over real gRPC, with real processes: redis-server, workers, schedulers.

Two workers serve the module (started in parallel once):
- "main": 256 KV blocks of 16 tokens, --max-model-len 512;
- "small": 16 KV blocks (256 tokens, below max-model-len 512), so a few requests force preemption and a
  request can be longer than the whole pool while still within max-model-len.

Each scheduler configuration runs in its own process with a fresh --namespace; a worker serves one scheduler at
a time (a new scheduler stops the previous one on that worker; its first plan resets the worker's batch).
Everything is greedy (temperature 0, ignore_eos). "Alone" references are the same requests run one at a time
beforehand, per worker, and cached for the module.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmserve.bench.metrics import summed_metrics
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster

SERVICE = "llmserve.v1.LLMServe"
RPC_TIMEOUT_S = 180
MAX_MODEL_LEN = 512
BATCH_TOKENS = 64
MAIN_BLOCKS = 256
SMALL_BLOCKS = 16
BLOCK_SIZE = 16
VOCAB = 49152
API_KEY = "s3cret-key"

WORKERS = {
    "main": ["--num-gpu-blocks-override", MAIN_BLOCKS, "--max-model-len", MAX_MODEL_LEN],
    "small": ["--num-gpu-blocks-override", SMALL_BLOCKS, "--max-model-len", MAX_MODEL_LEN,
              "--allow-kv-pool-below-max-model-len"],
}
_COMMON = ["--max-num-batched-tokens", BATCH_TOKENS, "--debug-invariants"]
# name -> (worker, scheduler flags); "--metrics-port" is added to every one.
SCHEDULERS = {
    "main": ("main", _COMMON),
    "apikey": ("main", [*_COMMON, "--api-key", API_KEY]),
    "small": ("small", _COMMON),
    "queue": ("small", [*_COMMON, "--max-num-seqs", 1, "--max-num-queued-requests", 1, "--queue-timeout", 1]),
    "small-sync": ("small", [*_COMMON, "--no-async-scheduling"]),
}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 40000) for _ in range(n)]


_rng = random.Random(1234)
# 16 requests: prompts of 5..300 tokens, outputs of 4..40 tokens.
_PROMPT_LENS = [5, 300, 12, 64, 150, 33, 7, 200, 90, 20, 240, 48, 9, 120, 17, 70]
_MAX_TOKENS = [40, 4, 24, 8, 12, 6, 30, 10, 16, 20, 5, 14, 36, 8, 18, 6]
WORKLOAD: list[tuple[list[int], int]] = [(_ids(_rng, n), m) for n, m in zip(_PROMPT_LENS, _MAX_TOKENS, strict=True)]
# Preemption: 4 x (48..72 prompt + 28 output) tokens need up to 4 x 7 blocks of a 16-block pool.
PREEMPT: list[tuple[list[int], int]] = [(_ids(_rng, n), 28) for n in (48, 56, 64, 72)]
TEXT_PROMPT = "The capital of France is"
CJK_PROMPT = "日本の首都は"


# ---- client helpers --------------------------------------------------------------------------------------------


@dataclass
class Out:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    usage: tuple[int, int] | None = None
    msgs: list[pb.GenerateResponse] = field(default_factory=list)


def make_request(prompt, max_tokens: int | None = None, rid: str = "", **sampling) -> pb.GenerateRequest:
    """prompt: token ids, text, or a list of (role, content) chat messages."""
    s = pb.SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **sampling})
    if max_tokens is not None:
        s.max_tokens = max_tokens
    req = pb.GenerateRequest(request_id=rid, sampling=s)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], tuple):
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in prompt)
    else:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    return req


def collect(msgs) -> Out:
    out = Out()
    for m in msgs:
        assert not out.finish, "a message after the final one"
        base = out.msgs[0].first_token_index if out.msgs else m.first_token_index
        assert m.first_token_index == base + len(out.tokens), "first_token_index does not follow the stream"
        out.msgs.append(m)
        out.tokens.extend(m.token_ids)
        out.text += m.text
        if m.finish_reason:
            out.finish = m.finish_reason
            out.usage = (m.usage.prompt_tokens, m.usage.completion_tokens)
    return out


def generate(stub, req: pb.GenerateRequest, metadata=None) -> Out:
    return collect(stub.Generate(req, timeout=RPC_TIMEOUT_S, metadata=metadata))


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    """Call fn (a unary call, or a streaming one consumed fully) and return the RpcError it must raise."""
    with pytest.raises(grpc.RpcError) as exc:
        res = fn(*args, timeout=RPC_TIMEOUT_S, **kw)
        if not isinstance(res, Message):
            list(res)  # a stream: the error comes while reading it
    return exc.value


def assert_error(err: grpc.RpcError, code: grpc.StatusCode, *words: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    for w in words:
        assert w in err.details(), f"{w!r} not in the {code.name} message {err.details()!r}"


def run_concurrently(fns, start_together: bool = True) -> list:
    """Run the callables in threads (started together); return their results in order (re-raising errors)."""
    barrier = threading.Barrier(len(fns))

    def wrap(fn):
        if start_together:
            barrier.wait(timeout=30)
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns)) as ex:
        futs = [ex.submit(wrap, fn) for fn in fns]
        return [f.result(timeout=RPC_TIMEOUT_S * 2) for f in futs]


def metrics(port: int) -> dict[str, float]:
    return summed_metrics(port, by_label=True)


# ---- the processes -------------------------------------------------------------------------------------------


class Cluster:
    """Module-wide processes: workers by name, at most one scheduler per worker, references per worker."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.workers: dict[str, cluster.Proc] = {}
        self.current: dict[str, tuple[str, cluster.Proc]] = {}  # worker name -> (scheduler config, proc)
        self.procs: list[cluster.Proc] = []
        self.channels: dict[int, grpc.Channel] = {}
        self.refs: dict[tuple, Out] = {}
        self._tokenizer = ThreadPoolExecutor(1).submit(self._load_tokenizer)

    @staticmethod
    def _load_tokenizer():
        from common.tokenizer import Tokenizer
        from worker_svc.model.loader import default_model_path

        return Tokenizer.from_gguf(default_model_path())

    def tokenizer(self):
        return self._tokenizer.result(timeout=120)

    def start_workers(self) -> None:
        pending = [cluster.start_worker(args, wait=False) for args in WORKERS.values()]
        self.procs += pending
        for name, proc in zip(WORKERS, pending, strict=True):
            self.workers[name] = cluster.wait_ready(proc)

    def scheduler(self, config: str) -> cluster.Proc:
        wname, flags = SCHEDULERS[config]
        cur = self.current.get(wname)
        if cur is not None and cur[0] == config and cur[1].alive():
            return cur[1]
        if cur is not None:
            self.close(cur[1])
        metrics_port = cluster.free_port()
        proc = cluster.start_scheduler(self.redis_url, self.workers[wname], [*flags, "--metrics-port", metrics_port],
                                       namespace=cluster.new_namespace(config))
        proc.extra["metrics_port"] = metrics_port
        proc.extra["config"] = config
        self.procs.append(proc)
        self.current[wname] = (config, proc)
        cluster.wait_healthy(proc.address, timeout=120, proc=proc)
        return proc

    def stub(self, proc: cluster.Proc) -> pb_grpc.LLMServeStub:
        if proc.port not in self.channels:
            self.channels[proc.port] = grpc.insecure_channel(proc.address)
        return pb_grpc.LLMServeStub(self.channels[proc.port])

    def close(self, proc: cluster.Proc) -> None:
        ch = self.channels.pop(proc.port, None)
        if ch is not None:
            ch.close()
        rc = cluster.stop(proc)
        assert rc == 0, f"{proc.describe()} did not exit cleanly on SIGTERM:\n{proc.log_tail()}"
        assert_clean_log(proc)

    def alone(self, proc: cluster.Proc, prompt, max_tokens: int, metadata=None, **sampling) -> Out:
        """The request run by itself on proc (cached per worker: same model, same worker process)."""
        wname = SCHEDULERS[proc.extra["config"]][0]
        key = (wname, repr(prompt), max_tokens, repr(sorted(sampling.items())))
        if key not in self.refs:
            self.refs[key] = generate(self.stub(proc), make_request(prompt, max_tokens, **sampling), metadata)
        return self.refs[key]

    def shutdown(self) -> None:
        for ch in self.channels.values():
            ch.close()
        # Schedulers first (they drive the workers), each group in parallel.
        for kind in ("scheduler", "worker"):
            group = [p for p in self.procs if p.name.startswith(kind)]
            if group:
                with ThreadPoolExecutor(len(group)) as ex:
                    list(ex.map(cluster.stop, group))
        self._tokenizer.cancel()


def assert_clean_log(proc: cluster.Proc) -> None:
    """No engine failure, invariant violation or traceback in a scheduler's log."""
    log = proc.log_text()
    for bad in ("Traceback", "INVARIANT", "engine iteration failed", "AssertionError"):
        assert bad not in log, f"{bad!r} in the log of {proc.describe()}:\n{proc.log_tail()}"


def wait_idle_ledger(redis_url: str, namespace: str, num_blocks: int, timeout: float = 30.0) -> dict:
    """Wait until the pool in Redis has every block free, no references and no active request."""
    ledger = cluster.ledger(redis_url, namespace)
    deadline = time.monotonic() + timeout
    while True:
        state = ledger.check_ledger()
        active = ledger.client.smembers(ledger.k_active)
        # Free capacity = never-used blocks + evictable prefix-cache blocks.
        if (state["free"] + state["evictable"] == state["total"] == num_blocks and state["allocated"] == 0
                and state["refs_sum"] == 0 and state["overlap"] == 0 and state["active"] == 0):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"pool {namespace} not idle after {timeout}s: {state}, active ids {active}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cl(redis_server):  # noqa: F811
    c = Cluster(redis_server)
    try:
        c.start_workers()
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def main(cl):
    proc = cl.scheduler("main")
    yield proc
    assert_clean_log(proc)


# ---- tests on the main worker ----------------------------------------------------------------------------------


def test_health_model_info_and_reflection(cl, main):
    assert cluster.health(main.address) == "SERVING"
    assert cluster.health(main.address, SERVICE) == "SERVING"
    info = cl.stub(main).GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    worker = cl.workers["main"]
    assert "smollm2" in info.model_name.lower() and info.model_path.endswith(".gguf")
    assert (info.max_model_len, info.vocab_size, info.block_size, info.num_blocks) == (
        MAX_MODEL_LEN, VOCAB, BLOCK_SIZE, MAIN_BLOCKS)
    assert (info.dtype, info.device, info.worker_epoch) == ("float32", "cpu", worker.epoch)
    assert info.max_num_batched_tokens == BATCH_TOKENS
    assert info.max_num_seqs == 64  # the CPU default

    db = ProtoReflectionDescriptorDatabase(cl.channels[main.port])
    services = db.get_services()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    svc = DescriptorPool(db).FindServiceByName(SERVICE)
    assert {m.name for m in svc.methods} == {"Generate", "Abort", "GetModelInfo", "Embed", "LoadLoraAdapter",
                                             "UnloadLoraAdapter"}
    assert svc.methods_by_name["Generate"].output_type.full_name == "llmserve.v1.GenerateResponse"


def test_concurrent_streams_equal_alone(cl, main):
    stub = cl.stub(main)
    t0 = time.monotonic()
    refs = [cl.alone(main, ids, m) for ids, m in WORKLOAD]
    t_alone = time.monotonic() - t0
    for (ids, m), ref in zip(WORKLOAD, refs, strict=True):
        assert ref.finish == "length" and len(ref.tokens) == m and ref.usage == (len(ids), m)
    before = metrics(main.extra["metrics_port"])

    t0 = time.monotonic()
    outs = run_concurrently([lambda ids=ids, m=m: generate(stub, make_request(ids, m)) for ids, m in WORKLOAD])
    t_conc = time.monotonic() - t0
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.tokens == ref.tokens, f"request {i} (prompt {len(WORKLOAD[i][0])} tokens) differs from alone"
        assert (out.finish, out.usage, out.text) == (ref.finish, ref.usage, ref.text)
    print(f"16 requests alone: {t_alone:.1f}s, concurrently: {t_conc:.1f}s")

    # Chunked prefill within the budget: no step above --max-num-batched-tokens, and steps were shared.
    after = metrics(main.extra["metrics_port"])
    steps = after["vllm:iteration_tokens_total_count"] - before.get("vllm:iteration_tokens_total_count", 0)
    within = (after['vllm:iteration_tokens_total_bucket|le=64.0']
              - before.get('vllm:iteration_tokens_total_bucket|le=64.0', 0))
    assert within == steps
    total_tokens = sum(len(ids) + m - 1 for ids, m in WORKLOAD)
    assert steps < total_tokens / 8, f"{steps} steps for {total_tokens} tokens: requests were not batched"
    assert after["vllm:request_success_total|finished_reason=length"] - before.get(
        "vllm:request_success_total|finished_reason=length", 0) == len(WORKLOAD)
    wait_idle_ledger(cl.redis_url, main.namespace, MAIN_BLOCKS)


def test_abort_and_client_cancel_free_blocks(cl, main):
    stub = cl.stub(main)
    others = [WORKLOAD[0], WORKLOAD[6], WORKLOAD[12]]  # 30..40 new tokens each: they outlive the victims
    refs = [cl.alone(main, ids, m) for ids, m in others]
    ledger = cluster.ledger(cl.redis_url, main.namespace)
    long_prompt = WORKLOAD[4][0]  # 150 tokens + up to 300 new: 29 blocks if it ran to the end
    rid_abort, rid_cancel = f"abort-{uuid.uuid4().hex[:6]}", f"cancel-{uuid.uuid4().hex[:6]}"
    rid_early = f"early-{uuid.uuid4().hex[:6]}"
    results: dict[str, object] = {}

    def aborted():
        msgs, abort_resp = [], None
        for m in stub.Generate(make_request(long_prompt, 300, rid=rid_abort), timeout=RPC_TIMEOUT_S):
            msgs.append(m)
            if abort_resp is None and sum(len(x.token_ids) for x in msgs) >= 3:
                abort_resp = stub.Abort(pb.AbortRequest(request_id=rid_abort), timeout=RPC_TIMEOUT_S)
        results["abort_found"] = abort_resp.found if abort_resp else None
        return collect(msgs)

    def cancelled():
        call = stub.Generate(make_request(long_prompt[:100], 300, rid=rid_cancel), timeout=RPC_TIMEOUT_S)
        got = 0
        for m in call:
            got += len(m.token_ids)
            if got >= 3:
                call.cancel()
                break
        with pytest.raises(grpc.RpcError) as exc:
            for _ in call:
                pass
        results["cancel_code"] = exc.value.code()
        return got

    def cancelled_early():
        # Cancelled before its first token: a 300-token prompt is still in (chunked) prefill, or even queued.
        call = stub.Generate(make_request(WORKLOAD[1][0], 100, rid=rid_early), timeout=RPC_TIMEOUT_S)
        time.sleep(0.3)
        call.cancel()
        with pytest.raises(grpc.RpcError) as exc:
            list(call)
        return exc.value.code()

    fns = [lambda ids=ids, m=m: generate(stub, make_request(ids, m)) for ids, m in others]
    early_code, *outs = run_concurrently([cancelled_early, aborted, cancelled, *fns])
    assert early_code == grpc.StatusCode.CANCELLED
    ab = outs[0]
    assert ab.finish == "abort" and results["abort_found"] is True
    assert 3 <= len(ab.tokens) < 300 and ab.usage == (len(long_prompt), len(ab.tokens))
    assert results["cancel_code"] == grpc.StatusCode.CANCELLED
    for out, ref in zip(outs[2:], refs, strict=True):
        assert out.tokens == ref.tokens and out.finish == "length"

    # Both victims ended in Redis with no blocks; the whole pool is free again.
    wait_idle_ledger(cl.redis_url, main.namespace, MAIN_BLOCKS)
    for rid in (rid_abort, rid_cancel, rid_early):
        req = ledger.get_request(rid)
        assert req is not None and req.finished and req.finish_reason == "abort" and req.block_ids == []
    assert stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=RPC_TIMEOUT_S).found is False
    # Aborting a finished request changes nothing.
    assert stub.Abort(pb.AbortRequest(request_id=rid_abort), timeout=RPC_TIMEOUT_S).found is True
    assert_error(rpc_error(stub.Abort, pb.AbortRequest()), grpc.StatusCode.INVALID_ARGUMENT, "request_id")


def test_admission_errors_name_field_and_limit(cl, main):
    stub = cl.stub(main)
    good = [WORKLOAD[0], WORKLOAD[12]]
    refs = [cl.alone(main, ids, m) for ids, m in good]
    short = WORKLOAD[2][0]
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        ("empty text prompt", make_request("", 4), ["prompt", "empty"]),
        ("empty token_ids prompt", make_request([], 4), ["prompt", "empty"]),
        ("no prompt", pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), ["prompt", "missing"]),
        ("prompt > max_model_len", make_request(_ids(random.Random(5), 600), 4),
         ["prompt", "600", "max_model_len", str(MAX_MODEL_LEN)]),
        ("max_tokens = 0", make_request(short, 0), ["max_tokens", ">= 1", "0"]),
        ("prompt + max_tokens > max_model_len", make_request(_ids(random.Random(6), 500), 20),
         ["max_tokens", "520", "max_model_len", str(MAX_MODEL_LEN)]),
        ("temperature < 0", make_request(short, 4, temperature=-0.5), ["temperature", ">= 0", "-0.5"]),
        ("top_p = 0", make_request(short, 4, top_p=0.0), ["top_p", "(0, 1]"]),
        ("top_p > 1", make_request(short, 4, top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
        ("top_k < -1", make_request(short, 4, top_k=-2), ["top_k", "-1", "-2"]),
        ("unknown chat role", make_request([("user", "hi"), ("wizard", "abracadabra")], 4),
         ["chat.messages[1].role", "wizard", "system", "user", "assistant", "tool"]),
        ("17 stop strings", make_request(short, 4, stop=[f"s{i}" for i in range(17)]), ["stop", "17", "16"]),
        ("a 257-byte stop string", make_request(short, 4, stop=["ok", "é" * 128 + "x"]),
         ["stop[1]", "257", "256"]),
        ("token id outside the vocabulary", make_request([1, 2, VOCAB], 4), ["token_ids", str(VOCAB)]),
    ]
    before = metrics(main.extra["metrics_port"])

    def bad_requests():
        time.sleep(0.5)  # let the good streams start
        errs = []
        for _name, req, _words in cases:
            errs.append(rpc_error(stub.Generate, req))
        return errs

    streams = [lambda ids=ids, m=m: generate(stub, make_request(ids, m)) for ids, m in good]
    *outs, errs = run_concurrently([*streams, bad_requests])
    for (_name, _req, words), err in zip(cases, errs, strict=True):
        assert_error(err, INVALID, *words)
    for out, ref in zip(outs, refs, strict=True):
        assert out.tokens == ref.tokens and out.finish == "length"
    after = metrics(main.extra["metrics_port"])
    # The refused requests never reached the engine.
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == len(good)
    # The edge cases that are fine: a prompt of max_model_len - 1 tokens with one new token, top_k = -1, 16 stops.
    edge = generate(stub, make_request(_ids(random.Random(7), MAX_MODEL_LEN - 1), 1, top_k=-1,
                                       stop=[f"zz{i}" for i in range(16)]))
    assert edge.finish == "length" and len(edge.tokens) == 1
    wait_idle_ledger(cl.redis_url, main.namespace, MAIN_BLOCKS)


def test_idempotent_request_id_reattaches(cl, main):
    stub = cl.stub(main)
    ids, m = WORKLOAD[6]  # 30 new tokens
    ref = cl.alone(main, ids, m)
    rid = f"idem-{uuid.uuid4().hex[:8]}"
    port = main.extra["metrics_port"]
    before = metrics(port)
    second: dict[str, Out] = {}

    k_live = 4

    def reattach():  # while the first call streams, from token k_live on
        req = make_request(ids, m, rid=rid)
        req.resume_from_token = k_live
        second["out"] = generate(stub, req)

    first_msgs, thread = [], None
    for msg in stub.Generate(make_request(ids, m, rid=rid), timeout=RPC_TIMEOUT_S):
        first_msgs.append(msg)
        if thread is None and sum(len(x.token_ids) for x in first_msgs) >= 3:
            thread = threading.Thread(target=reattach)  # same id while the first one streams
            thread.start()
    thread.join(timeout=RPC_TIMEOUT_S)
    first = collect(first_msgs)
    assert first.tokens == ref.tokens and first.finish == "length"
    live = second["out"]
    assert live.tokens == ref.tokens[k_live:] and live.finish == "length" and live.usage == ref.usage
    assert live.msgs[0].first_token_index == k_live

    again = generate(stub, make_request(ids, m, rid=rid))  # after it finished
    assert again.tokens == ref.tokens and again.finish == "length" and again.text == ref.text
    k = 11
    req = make_request(ids, m, rid=rid)
    req.resume_from_token = k
    tail = generate(stub, req)
    assert tail.tokens == ref.tokens[k:] and tail.finish == "length"
    assert tail.msgs[0].first_token_index == k
    assert tail.usage == (len(ids), m)

    # Only one request ran: one success, m generated tokens, one prompt's worth of prefill.
    after = metrics(port)
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 1
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == m
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == len(ids)


def _stop_string_at(text: str, start: int) -> str:
    """A 4..6 character substring from `start` whose first occurrence in text is at `start`."""
    for n in (6, 5, 4):
        s = text[start:start + n]
        if len(s) == n and text.find(s) == start and s.strip():
            return s
    raise AssertionError(f"no usable stop string at {start} in {text!r}")


def test_stop_strings_and_text_deltas(cl, main):
    stub = cl.stub(main)
    tok = cl.tokenizer()
    ref = cl.alone(main, TEXT_PROMPT, 24)
    assert ref.tokens and ref.text == tok.decode(ref.tokens)
    assert ref.usage == (len(tok.encode(TEXT_PROMPT)), 24)
    # A stop string that starts 2 characters before the end of the 5th token's text: it spans tokens.
    cut = len(tok.decode(ref.tokens[:5])) - 2
    stop = _stop_string_at(ref.text, cut)

    rid = f"stop-{uuid.uuid4().hex[:6]}"

    def run(rid="", **kw):
        return generate(stub, make_request(TEXT_PROMPT, 24, rid=rid, stop=["never-appears", stop], **kw))

    chat = [("system", "You are terse."), ("user", "Name a colour.")]
    plain, incl, cjk, chatted = run_concurrently([
        lambda: run(rid), lambda: run(include_stop_str_in_output=True),
        lambda: generate(stub, make_request(CJK_PROMPT, 16)), lambda: generate(stub, make_request(chat, 8))])
    assert plain.finish == "stop" and plain.text == ref.text[:cut], (stop, plain.text, ref.text)
    assert incl.finish == "stop" and incl.text == ref.text[:cut + len(stop)]
    for out in (plain, incl):
        # Tokens stop at the one that completed the stop string; the text is their decode up to the stop.
        assert out.tokens == ref.tokens[:len(out.tokens)] and len(out.tokens) < 24
        full = tok.decode(out.tokens)
        assert full.find(stop) == cut and stop not in tok.decode(out.tokens[:-1])
        assert out.usage == (ref.usage[0], len(out.tokens))
    assert "".join(m.text for m in plain.msgs) == plain.text

    # Multi-byte text: no half characters in any delta, and the deltas add up to the decode of the ids.
    assert cjk.finish == "length" and len(cjk.tokens) == 16
    assert all("\ufffd" not in m.text for m in cjk.msgs[:-1])
    assert cjk.text == tok.decode(cjk.tokens)
    # A chat prompt is rendered with the model's template.
    rendered = tok.encode(tok.apply_chat_template([{"role": r, "content": c} for r, c in chat]),
                          add_special_tokens=False)
    assert chatted.finish == "length" and chatted.usage == (len(rendered), 8)
    assert chatted.text == tok.decode(chatted.tokens)

    # Re-attaching to a request that ended on a stop string replays the same cut.
    again = generate(stub, make_request(TEXT_PROMPT, 24, rid=rid, stop=["never-appears", stop]))
    assert (again.tokens, again.text, again.finish) == (plain.tokens, plain.text, "stop")
    wait_idle_ledger(cl.redis_url, main.namespace, MAIN_BLOCKS)


def test_cli_generate_json_and_error(cl, main):
    ref = cl.alone(main, TEXT_PROMPT, 24)
    base = [sys.executable, "-m", "llmserve.cli", "generate", "--server", main.address]
    good = base + ["--json", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", TEXT_PROMPT]
    bad = base + ["--temperature", "-1", TEXT_PROMPT]

    def run(argv):
        return subprocess.run(argv, capture_output=True, text=True, timeout=RPC_TIMEOUT_S, cwd=cluster.ROOT)

    ok, err = run_concurrently([lambda: run(good), lambda: run(bad)], start_together=False)
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.strip()]
    *msgs, final = lines
    assert final["finish_reason"] == "length" and final["token_ids"] == ref.tokens[:8]
    assert final["text"] == "".join(m["text"] for m in msgs) == cl.tokenizer().decode(ref.tokens[:8])
    assert [t for m in msgs for t in m["token_ids"]] == final["token_ids"]
    assert msgs[-1]["finish_reason"] == "length" and msgs[-1]["usage"]["completion_tokens"] == 8
    assert all(m["request_id"] == final["request_id"] for m in msgs)

    assert err.returncode != 0
    assert "INVALID_ARGUMENT" in err.stderr and "temperature" in err.stderr and "-1" in err.stderr, err.stderr


# ---- tests on the small worker -----------------------------------------------------------------------------------


def test_preemption_keeps_outputs_and_frees_every_block(cl):
    small = cl.scheduler("small")
    stub = cl.stub(small)
    refs = [cl.alone(small, ids, m) for ids, m in PREEMPT]
    port = small.extra["metrics_port"]
    before = metrics(port).get("vllm:num_preemptions_total", 0.0)
    rids = [f"pre-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(PREEMPT))]

    def never_fits():
        time.sleep(0.3)  # while the others run: refused at once, nothing else disturbed
        return rpc_error(stub.Generate, make_request(_ids(random.Random(8), 200), 100))

    streams = [lambda ids=ids, m=m, rid=rid: generate(stub, make_request(ids, m, rid=rid))
               for (ids, m), rid in zip(PREEMPT, rids, strict=True)]
    t0 = time.monotonic()
    *outs, err = run_concurrently([*streams, never_fits])
    print(f"preemption run: {time.monotonic() - t0:.1f}s, "
          f"{metrics(port).get('vllm:num_preemptions_total', 0.0) - before:.0f} preemptions")
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.tokens == ref.tokens and out.finish == "length", f"request {i} changed under preemption"
    assert metrics(port).get("vllm:num_preemptions_total", 0.0) > before
    ledger = cluster.ledger(cl.redis_url, small.namespace)
    assert sum(ledger.get_request(rid).num_preemptions for rid in rids) > 0
    assert_error(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "300", "KV pool", str(SMALL_BLOCKS * BLOCK_SIZE))
    wait_idle_ledger(cl.redis_url, small.namespace, SMALL_BLOCKS)
    assert_clean_log(small)


def test_full_queue_and_queue_timeout(cl):
    sched = cl.scheduler("queue")  # --max-num-seqs 1 --max-num-queued-requests 1 --queue-timeout 1
    stub = cl.stub(sched)
    (ids_a, _), ids_b = PREEMPT[0], PREEMPT[1][0]
    m_a = 150  # long enough that B outwaits the 1 s queue timeout behind it, however fast the worker is
    ref = cl.alone(sched, ids_a, m_a)
    ledger = cluster.ledger(cl.redis_url, sched.namespace)
    rid_b = f"waits-{uuid.uuid4().hex[:6]}"
    events: dict[str, object] = {}

    def run_b():
        t0 = time.monotonic()
        events["b_err"] = rpc_error(stub.Generate, make_request(ids_b, 8, rid=rid_b))
        events["b_after"] = time.monotonic() - t0
        events["b_end"] = time.monotonic()

    b_thread = threading.Thread(target=run_b)
    msgs = []
    for msg in stub.Generate(make_request(ids_a, m_a), timeout=RPC_TIMEOUT_S):
        msgs.append(msg)
        if b_thread.ident is not None:
            continue
        # A runs (the only seat); B waits in the queue (now full); C is refused at once.
        b_thread.start()
        deadline = time.monotonic() + 30
        while not ledger.client.sismember(ledger.k_active, rid_b) and b_thread.is_alive():
            assert time.monotonic() < deadline, "B never reached the waiting queue"
            time.sleep(0.02)
        events["c_err"] = rpc_error(stub.Generate, make_request(ids_b, 8))
    a_end = time.monotonic()
    a = collect(msgs)
    b_thread.join(timeout=60)

    assert_error(events["c_err"], grpc.StatusCode.RESOURCE_EXHAUSTED, "queue", "--max-num-queued-requests", "1")
    assert_error(events["b_err"], grpc.StatusCode.DEADLINE_EXCEEDED, rid_b, "--queue-timeout", "1s")
    assert events["b_end"] < a_end, "B should time out while A still runs"
    # Not before its 1 s --queue-timeout (a lower bound: a loaded box only makes the wait longer, never shorter).
    assert events["b_after"] >= 0.9
    assert a.tokens == ref.tokens and a.finish == "length"
    req_b = ledger.get_request(rid_b)
    assert req_b.finished and req_b.output_ids == [] and req_b.block_ids == []
    wait_idle_ledger(cl.redis_url, sched.namespace, SMALL_BLOCKS)
    assert_clean_log(sched)


# ---- other schedulers --------------------------------------------------------------------------------------------


def test_api_key(cl):
    sched = cl.scheduler("apikey")  # on the main worker: wait_healthy already ran without any key
    assert cluster.health(sched.address) == "SERVING"
    stub = cl.stub(sched)
    ids, m = WORKLOAD[3]
    UNAUTH = grpc.StatusCode.UNAUTHENTICATED
    for md in (None, [("authorization", "Bearer wrong")], [("authorization", API_KEY)]):
        assert_error(rpc_error(stub.Generate, make_request(ids, m), metadata=md), UNAUTH, "API key", "Bearer")
        assert_error(rpc_error(stub.Abort, pb.AbortRequest(request_id="x"), metadata=md), UNAUTH, "API key")
        assert_error(rpc_error(stub.GetModelInfo, pb.GetModelInfoRequest(), metadata=md), UNAUTH, "API key")
    good = [("authorization", f"Bearer {API_KEY}")]
    out = generate(stub, make_request(ids, m), metadata=good)
    ref = cl.refs.get(("main", repr(ids), m, repr([])))
    assert out.finish == "length" and len(out.tokens) == m
    if ref is not None:  # computed by the main scheduler on this same worker
        assert out.tokens == ref.tokens
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=RPC_TIMEOUT_S).num_blocks == MAIN_BLOCKS
    assert stub.Abort(pb.AbortRequest(request_id="x"), metadata=good, timeout=RPC_TIMEOUT_S).found is False


def test_sigterm_drains_then_exits(cl):
    """SIGTERM: the scheduler stops serving (new calls UNAVAILABLE), streams in flight end UNAVAILABLE (clients
    re-attach elsewhere by request id), the request stays in Redis for the next leader, and it exits with 0."""
    sched = cl.scheduler("apikey")
    stub = cl.stub(sched)
    key = [("authorization", f"Bearer {API_KEY}")]
    rid = f"drain-{uuid.uuid4().hex[:6]}"
    seen: list[str] = []
    polling = threading.Event()

    def poll_health():
        while sched.alive():
            seen.append(cluster.health(sched.address, timeout=1.0))
            polling.set()
            time.sleep(0.05)

    call = stub.Generate(make_request(WORKLOAD[0][0], 200, rid=rid), metadata=key, timeout=RPC_TIMEOUT_S)
    got = len(next(call).token_ids)
    while got < 2:
        got += len(next(call).token_ids)
    poller = threading.Thread(target=poll_health)
    poller.start()
    polling.wait(10)
    t0 = time.monotonic()
    sched.popen.send_signal(signal.SIGTERM)
    late = None
    with pytest.raises(grpc.RpcError) as exc:
        for _ in call:
            if late is None and time.monotonic() - t0 > 1.0:
                late = rpc_error(stub.Generate, make_request([1, 2, 3], 2), metadata=key)
    try:
        rc = sched.popen.wait(timeout=60)  # a hang guard: it exits as soon as the streams are closed
    finally:
        poller.join(timeout=30)
        cl.current.pop("main", None)
        cl.close(sched)
    assert rc == 0
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    # Once it stops serving (NOT_SERVING, the listener refusing calls: UNAVAILABLE, or a probe in flight as the server
    # stops: CANCELLED, seen once in a CI run) it never serves again.
    first_off = next(i for i, h in enumerate(seen) if h != "SERVING")
    assert set(seen[first_off:]) <= {"NOT_SERVING", "UNAVAILABLE", "CANCELLED"}, seen
    if late is not None:  # a new call while draining
        assert late.code() == grpc.StatusCode.UNAVAILABLE, late
    req = cluster.ledger(cl.redis_url, sched.namespace).get_request(rid)
    assert req is not None and not req.finished and len(req.output_ids) >= 2


def test_no_worker_is_unavailable(cl):
    dead = f"127.0.0.1:{cluster.free_port()}"  # nothing listens there
    sched = cluster.start_scheduler(cl.redis_url, dead, ["--metrics-port", cluster.free_port()])
    cl.procs.append(sched)
    try:
        stub = pb_grpc.LLMServeStub(grpc.insecure_channel(sched.address))
        for _ in range(5):
            assert cluster.health(sched.address) == "NOT_SERVING"
            assert cluster.health(sched.address, SERVICE) == "NOT_SERVING"
            time.sleep(0.2)
        assert_error(rpc_error(stub.Generate, make_request([1, 2, 3], 4)), grpc.StatusCode.UNAVAILABLE,
                     "no worker")
        assert_error(rpc_error(stub.GetModelInfo, pb.GetModelInfoRequest()), grpc.StatusCode.UNAVAILABLE,
                     "no worker")
    finally:
        cluster.stop(sched)
    assert_clean_log(sched)


def test_async_and_sync_scheduling_give_identical_outputs(cl):
    """The same preempting concurrent run with the commit overlapping the next forward (the default) and with
    --no-async-scheduling: token for token equal to each request alone, and a clean ledger after each."""
    for config in ("small", "small-sync"):
        proc = cl.scheduler(config)
        stub = cl.stub(proc)
        refs = [cl.alone(proc, ids, m) for ids, m in PREEMPT]
        before = metrics(proc.extra["metrics_port"]).get("vllm:num_preemptions_total", 0.0)
        outs = run_concurrently([lambda ids=ids, m=m, stub=stub: generate(stub, make_request(ids, m))
                                 for ids, m in PREEMPT])
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            assert out.tokens == ref.tokens and out.finish == ref.finish, f"{config}: request {i} differs"
        after = metrics(proc.extra["metrics_port"])
        assert after.get("vllm:num_preemptions_total", 0.0) > before, f"{config}: the run was meant to preempt"
        assert after["llmserve:worker_forward_seconds_total"] > 0 and after["llmserve:step_seconds_count"] > 0
        assert after["llmserve:redis_commit_seconds_count"] > 0
        wait_idle_ledger(cl.redis_url, proc.namespace, SMALL_BLOCKS)
        assert_clean_log(proc)
