"""Speculative decoding end to end (real worker, scheduler and Redis): with --speculative-config on, a mixed batch of
repetitive and random prompts -- greedy, seeded sampling, n = 2, a stop string, a regex-constrained one -- on a
16-block pool that preempts, with chunked prefill and prefix caching on, pipelined and not, gives token for token
what each request gives alone without speculation; drafts are accepted and counted, and the block ledger ends
clean. Start-up refuses bad configurations naming the flag and the key."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest

from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_scheduler_e2e import (
    PREEMPT,
    RPC_TIMEOUT_S,
    SMALL_BLOCKS,
    WORKERS,
    _stop_string_at,
    assert_clean_log,
    make_request,
    metrics,
    run_concurrently,
    wait_idle_ledger,
)
from tests.support import cluster
from tests.support.module_worker import running_worker

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
COUNT = "1, 2, 3, 4, 5, 6,"
COUNT_RE = r" ?[0-9]{1,3}(, [0-9]{1,3}){2,5}"
# (prompt, max_tokens, sampling extras): repetitive prompts (drafts accepted), random ones (the pool runs dry).
CASES = [(CODE, 40, {}), (COUNT, 40, {}), (COUNT, 24, {"temperature": 0.8, "seed": 11}),
         (CODE, 24, {"temperature": 0.7, "top_p": 0.9, "seed": 5, "n": 2}),
         *((ids, m, {}) for ids, m in PREEMPT[:3]),
         (COUNT, 24, {"regex": COUNT_RE})]  # a structured output: its drafts cut and verified under its grammar


def run(stub, prompt, max_tokens, **sampling) -> dict[int, tuple[list[int], str, str]]:
    """sequence index -> (tokens, text, finish reason)."""
    out: dict[int, tuple[list[int], str, str]] = {}
    req = make_request(prompt, max_tokens, **sampling)
    for m in stub.Generate(req, timeout=RPC_TIMEOUT_S):
        toks, text, _ = out.get(m.index, ([], "", ""))
        out[m.index] = (toks + list(m.token_ids), text + m.text, m.finish_reason)
    return out


@pytest.fixture(scope="module")
def worker():
    with running_worker(WORKERS["small"]) as w:
        yield w


def scheduler(redis_url, worker, *flags) -> tuple[cluster.Proc, grpc.Channel]:
    port = cluster.free_port()
    proc = cluster.start_scheduler(redis_url, worker, ["--max-num-batched-tokens", 64, "--debug-invariants",
                                                       "--metrics-port", port, *flags])
    proc.extra["metrics_port"] = port
    cluster.wait_healthy(proc.address, timeout=120, proc=proc)
    return proc, grpc.insecure_channel(proc.address)


@pytest.fixture(scope="module")
def refs(redis_server, worker):  # noqa: F811
    """Each case alone without speculation, and the first code case again with a stop string from its middle."""
    plain, ch = scheduler(redis_server, worker)
    stub = pb_grpc.LLMServeStub(ch)
    refs = [run(stub, p, m, **kw) for p, m, kw in CASES]
    assert re.fullmatch(COUNT_RE, refs[-1][0][1]) and refs[-1][0][2] == "stop", refs[-1]
    code_text = refs[0][0][1]
    stop = _stop_string_at(code_text, len(code_text) // 2)
    stop_ref = run(stub, CODE, 40, stop=[stop])
    assert stop_ref[0][2] == "stop"
    ch.close()
    cluster.stop(plain)
    assert_clean_log(plain)
    return refs, stop, stop_ref


# Not pipelined is slow: the same cases and checks run pipelined (the default) here, and the core's token and block
# accounting with speculation is checked both ways in tests/unit/test_speculative.py.
@pytest.mark.parametrize("flags", [[], pytest.param(["--no-async-scheduling"], marks=pytest.mark.slow)],
                         ids=["pipelined", "not-pipelined"])
def test_speculation_equals_plain_decoding_under_every_mode(redis_server, worker, refs, flags):  # noqa: F811
    refs, stop, stop_ref = refs
    proc, ch = scheduler(redis_server, worker, "--speculative-config", SPEC, *flags)
    stub = pb_grpc.LLMServeStub(ch)
    outs = run_concurrently([lambda p=p, m=m, kw=kw, stub=stub: run(stub, p, m, **kw) for p, m, kw in CASES]
                            + [lambda stub=stub: run(stub, CODE, 40, stop=[stop])])
    for i, (out, ref) in enumerate(zip(outs, [*refs, stop_ref], strict=True)):
        assert out == ref, f"{flags}: case {i} differs with speculation on"
    got = metrics(proc.extra["metrics_port"])
    assert got.get("vllm:num_preemptions_total", 0) > 0, "the run was meant to preempt"
    assert got["vllm:spec_decode_num_draft_tokens_total"] >= got["vllm:spec_decode_num_accepted_tokens_total"]
    assert got["vllm:spec_decode_num_accepted_tokens_total"] > 10
    assert got["vllm:spec_decode_num_drafts_total"] > 0
    assert got.get("vllm:spec_decode_num_accepted_tokens_per_pos_total|position=0", 0) > 0
    wait_idle_ledger(redis_server, proc.namespace, SMALL_BLOCKS)
    ch.close()
    cluster.stop(proc)
    assert_clean_log(proc)


@pytest.mark.parametrize(("flags", "words"), [
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     ["--speculative-config", "method", "eagle"]),
    (["--speculative-config", '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}'],
     ["--speculative-config", "prompt_lookup_min", "prompt_lookup_max"]),
    (["--speculative-config", '{"num_speculative_tokens": 2}', "--scheduling-mode", "static"],
     ["--speculative-config", "--scheduling-mode"]),
])
def test_bad_speculative_config_is_refused_at_start(flags, words):
    res = subprocess.run([sys.executable, "-m", "llmserve.cli", "scheduler", "--redis-url", "redis://127.0.0.1:1",
                          *flags], capture_output=True, text=True, timeout=120, cwd=cluster.ROOT)
    assert res.returncode != 0
    for w in words:
        assert w in res.stderr, res.stderr
