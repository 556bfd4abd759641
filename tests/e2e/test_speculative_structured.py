"""Structured outputs with speculation on (real worker, scheduler and Redis; the bundled model): JSON schemas,
a regex, a choice and an EBNF grammar, greedy and seeded-sampled, drafted by each proposer -- n-gram lookup, the
bundled model as its own draft (method draft_model: most drafts accepted) and a random-weight EAGLE-3 head (most
rejected). Every output is valid, and token for token what the same request gives without speculation (the same
worker, a scheduler that grants no draft slots) -- for a draft model's sampled request its distribution, not the
same draw (docs/architecture.md). The constrained requests verified drafts: drafts that the grammar rejects were
cut before verification (a draft model draws from q masked by the grammar), the accepted ones fit it
(worker_svc/core/grammar_drafts.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_scheduler_e2e import assert_clean_log, metrics, run_concurrently
from tests.e2e.test_speculative import run, scheduler
from tests.e2e.test_structured_outputs import ARITHMETIC, ARITHMETIC_RE, SCHEMAS
from tests.support import cluster
from tests.support.spec_heads import bundled_model_dims, write_eagle3_head

K = 3
COUNT_RE = r"[0-9]{1,3}(, [0-9]{1,3}){3,6}"
# (name, prompt, max_tokens, sampling): each constrained.
CASES = [
    ("person", "Reply with a JSON value for a person.", 48, {"json_schema": json.dumps(SCHEMAS["person"])}),
    ("tags", "Reply with a JSON list of tags.", 48,
     {"json_schema": json.dumps(SCHEMAS["tags"]), "temperature": 0.8, "seed": 7}),
    ("count", "1, 2, 3, 4, 5, 6, 7, 8,", 40, {"regex": COUNT_RE}),
    ("choice", "Is the sky blue? Answer.", 8, {"choice": pb.ChoiceConstraint(choices=["yes", "no", "not sure"])}),
    ("sum", "Write a sum.", 32, {"grammar": ARITHMETIC}),
]


def assert_valid(name: str, sampling: dict, text: str, finish: str) -> None:
    assert finish == "stop", f"{name}: the constraint did not complete: {text!r}"
    if "json_schema" in sampling:
        jsonschema.validate(json.loads(text), json.loads(sampling["json_schema"]))
    elif "regex" in sampling:
        assert re.fullmatch(sampling["regex"], text), (name, text)
    elif "choice" in sampling:
        assert text in sampling["choice"].choices, (name, text)
    else:
        assert ARITHMETIC_RE.match(text), (name, text)


def run_cases(redis_server, worker, cases: list[tuple], *flags) -> tuple[list, dict[str, float]]:
    """The (prompt, max_tokens, sampling) cases at once through a scheduler started for them (`flags` added) and
    stopped after, its log clean: the outputs in order and the scheduler's metrics."""
    proc, ch = scheduler(redis_server, worker, *flags)
    try:
        stub = pb_grpc.LLMServeStub(ch)
        outs = run_concurrently([lambda p=p, m=m, kw=kw: run(stub, p, m, **kw) for p, m, kw in cases])
        got = metrics(proc.extra["metrics_port"])
    finally:
        ch.close()
        cluster.stop(proc)
    assert_clean_log(proc)
    return outs, got


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle3"])
def spec(request, tmp_path_factory, bundled_model_path) -> str:
    method = request.param
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3})
    model = bundled_model_path if method == "draft_model" else write_eagle3_head(
        str(tmp_path_factory.mktemp("eagle3")), aux_layers=None, dims=bundled_model_dims(), draft_vocab=2048)
    return json.dumps({"method": method, "model": model, "num_speculative_tokens": K})


def test_structured_outputs_with_drafts_are_valid_and_equal_plain_decoding(redis_server, spec):  # noqa: F811
    worker = cluster.start_worker(["--num-gpu-blocks-override", 64, "--max-model-len", 256,
                                   "--structured-outputs-config", '{"disable_any_whitespace": true}',
                                   "--speculative-config", spec])
    try:
        plain, ch = scheduler(redis_server, worker)
        stub = pb_grpc.LLMServeStub(ch)
        refs = [run(stub, p, m, **kw) for _, p, m, kw in CASES]
        ch.close()
        cluster.stop(plain)
        assert_clean_log(plain)
        for (name, _, _, kw), ref in zip(CASES, refs, strict=True):
            assert_valid(name, kw, ref[0][1], ref[0][2])
        outs, got = run_cases(redis_server, worker, [case[1:] for case in CASES], "--speculative-config", spec)
    finally:
        cluster.stop(worker)
    for (name, _, _, kw), out, ref in zip(CASES, outs, refs, strict=True):
        assert_valid(name, kw, out[0][1], out[0][2])
        if "draft_model" in spec and kw.get("temperature"):
            continue  # rejection sampling of a draft model's q: the target's distribution, not the same draw
        assert out == ref, f"{name} differs with speculation on"
    drafted = got["vllm:spec_decode_num_draft_tokens_total"]
    assert drafted > 0, "the constrained requests were meant to verify drafts"
    assert drafted >= got["vllm:spec_decode_num_accepted_tokens_total"]
    if "draft_model" in spec:
        assert got["vllm:spec_decode_num_accepted_tokens_total"] > 0.5 * drafted, got


# MTP: a Qwen3.5 checkpoint's own random-weight MTP layer (rejected drafts also roll back out of the recurrent state);
# its word-level tokenizer has the tokens t0 .. t319; the regex admits t1, t10 .. t19 and t100 .. t199 (no dead end).
WORDS_RE = r"(t1[0-9]{0,2})+"


def test_structured_outputs_with_mtp_drafts_equal_plain_decoding(redis_server, tmp_path):  # noqa: F811
    from tests.e2e.test_hybrid_serving import token_prompt
    from tests.e2e.test_model_families_served import word_tokenizer
    from tests.service.test_hybrid_families import make_checkpoint
    from tests.support.spec_heads import add_mtp_layer

    hf = make_checkpoint("qwen3_5", tmp_path)
    word_tokenizer(tmp_path, hf.config.vocab_size)
    add_mtp_layer(str(tmp_path))
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    worker = cluster.start_worker(["--model", str(tmp_path), "--num-gpu-blocks-override", 48, "--max-model-len", 256,
                                   "--num-state-slots", 6, "--speculative-config", mtp])
    cases = [(token_prompt(n, 800 + n), 16, {"regex": WORDS_RE, **kw})
             for n, kw in ((9, {}), (30, {}), (17, {"temperature": 0.9, "seed": 4}))]
    cases.append((token_prompt(12, 820), 16, {}))  # beside an unconstrained request
    try:
        plain, _ = run_cases(redis_server, worker, cases)
        spec_out, got = run_cases(redis_server, worker, cases, "--speculative-config", mtp)
    finally:
        cluster.stop(worker)
    assert spec_out == plain
    for (_, _, kw), out in zip(cases, spec_out, strict=True):
        if "regex" in kw:
            assert re.fullmatch(WORDS_RE, out[0][1].replace(" ", "")), out[0][1]
    assert got["vllm:spec_decode_num_draft_tokens_total"] > 0
