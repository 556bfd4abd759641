"""Structured outputs: what constrained decoding costs, measured three ways.

1. Serving (a private redis-server, one worker process with the bundled model, the scheduler in this process): one
   wave of N JSON-schema requests and N unconstrained ones submitted at once (chat prompts, temperature 0, at most
   M new tokens; the unconstrained ones `ignore_eos`), after a baseline wave of 2N unconstrained requests in the
   same run. Per class: output tokens/s (its tokens / (first submit -> its last stream end)), ITL p50/p99 (gaps
   between streamed messages), and whether every constrained output validates (the `jsonschema` package).
2. Grammar compile time per schema against the model's vocabulary (in process,
   `worker_svc.sampling.grammar.GrammarCache`): cold (first request) and cached (the next one).
3. The cost of masking per step at R running requests (in process): fill the R rows' bitmasks, apply them to
   [R, vocab] logits, advance the matchers; against the plain greedy sampling of the same logits.

    .venv/bin/python -m experiments.structured_outputs                        # N=32, M=32, R=64
    .venv/bin/python -m experiments.structured_outputs --num-requests 8 --skip-serving --json out.json

Results and commands: experiments/STRUCTURED_OUTPUTS.md.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from llmserve import client, processes
from llmserve.bench.metrics import metric_sum, percentile, scrape
from protos import llmserve_pb2 as pb
from tests.support.stack import Stack

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "city": {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "population": {"type": "integer", "minimum": 1}},
        "required": ["name", "population"]}}, "required": ["city"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L"]}}, "required": ["color", "size"]},
    "review": {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10},
                                                "passed": {"type": "boolean"}, "note": {"type": "string",
                                                                                        "maxLength": 20}},
               "required": ["score", "passed"]},
    "codes": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["code", "zip"]},
    "items": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"]}}}, "required": ["items"]},
    "emails": {"type": "object", "properties": {f"email_{i}": {
        "type": "string", "pattern": "^[a-z]{3,8}@[a-z]{2,6}\\.(com|org|net)$"} for i in range(20)},
        "required": [f"email_{i}" for i in range(20)]},  # slow to compile
}


def chat(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]),
                              sampling=pb.SamplingParams(temperature=0.0, **sampling))


def run_wave(address: str, reqs: dict[str, pb.GenerateRequest]) -> dict[str, dict]:
    """Submit every request at once (a thread each); per request: tokens, text, finish, message times."""
    out: dict[str, dict] = {}

    def one(key: str, req: pb.GenerateRequest) -> None:
        times: list[float] = []

        def arrived(m: pb.GenerateResponse) -> None:
            if m.token_ids:
                times.append(time.monotonic())

        res = client.stream(req, address, on_message=arrived)
        out[key] = {"tokens": len(res.token_ids[0]), "text": "".join(res.text[0]), "finish": res.finish[0] or "",
                    "times": times}

    threads = [threading.Thread(target=one, args=kv) for kv in reqs.items()]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in out.values():
        rec["start"] = start
    return out


def summarize(recs: list[dict]) -> dict:
    gaps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:], strict=False)]
    end = max(r["times"][-1] for r in recs)
    tokens = sum(r["tokens"] for r in recs)
    return {"requests": len(recs), "output_tokens": tokens, "tok_per_s": tokens / (end - recs[0]["start"]),
            "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99)}


def serving(n: int, max_tokens: int) -> dict:
    import jsonschema

    names = [n for n in SCHEMAS if n != "emails"]  # emails: for the compile time only (its output is long)
    plain_prompts = ["Tell me about the ocean.", "Write a short poem about rain.", "Explain how a bicycle works.",
                     "Describe your favourite city."]
    with Stack(["--num-gpu-blocks-override", "1024",
                      "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
                     ["--max-num-seqs", str(2 * n)]) as st:
        metrics_port = processes.free_port()
        st.driver.metrics.serve(metrics_port)
        warm = {f"w{i}": chat(f"Reply with a JSON value for a {name}.", max_tokens=max_tokens,
                              json_schema=json.dumps(SCHEMAS[name])) for i, name in enumerate(names)}
        run_wave(st.address, warm)  # compiles every schema once, loads the detokenizer
        plain = {f"p{i}": chat(plain_prompts[i % 4] + f" ({i})", max_tokens=max_tokens, ignore_eos=True)
                 for i in range(2 * n)}
        baseline = run_wave(st.address, plain)
        mixed_reqs = {**{f"p{i}": plain[f"p{i}"] for i in range(n)},
                      **{f"j{i}": chat(f"Reply with a JSON value for a {names[i % len(names)]} ({i}).",
                                       max_tokens=max_tokens, json_schema=json.dumps(SCHEMAS[names[i % len(names)]]))
                         for i in range(n)}}
        masked0 = metric_sum(scrape(f"http://127.0.0.1:{metrics_port}/metrics"),
                             "llmserve:structured_output_masked_tokens_total")
        mixed = run_wave(st.address, mixed_reqs)
        sample = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    valid = length = 0
    for i in range(n):
        rec = mixed[f"j{i}"]
        if rec["finish"] == "length":  # cut by --max-tokens: not expected to parse
            length += 1
            continue
        try:
            jsonschema.validate(json.loads(rec["text"]), SCHEMAS[names[i % len(names)]])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {
        "baseline_unconstrained": summarize(list(baseline.values())),
        "mixed_unconstrained": summarize([mixed[f"p{i}"] for i in range(n)]),
        "mixed_json_schema": summarize([mixed[f"j{i}"] for i in range(n)]),
        "json_valid": f"{valid}/{n - length}",  # of those that finished with stop
        "json_cut_by_max_tokens": length,
        "masked_tokens": metric_sum(sample, "llmserve:structured_output_masked_tokens_total") - masked0,
        "mask_seconds_total": metric_sum(sample, "llmserve:structured_output_mask_seconds_total"),
    }


def compile_times() -> dict:
    from gguf import GGUFReader

    from common.structured_outputs import Constraint
    from worker_svc.model.loader import default_model_path, gguf_vocabulary
    from worker_svc.sampling.grammar import GrammarCache

    reader = GGUFReader(default_model_path())
    vocabulary = gguf_vocabulary(reader)
    cfg = argparse.Namespace(vocab_size=len(vocabulary[0]),
                             eos_token_ids=[int(reader.fields["tokenizer.ggml.eos_token_id"].contents())])
    cache = GrammarCache(default_model_path(), cfg.vocab_size, cfg.eos_token_ids, vocabulary=vocabulary)
    t0 = time.perf_counter()
    cache.compiler()
    out = {"vocabulary_seconds": time.perf_counter() - t0, "schemas": {}}
    for name, schema in SCHEMAS.items():
        c = Constraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        cache.get(c)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.get(c)
        out["schemas"][name] = {"cold_ms": 1000 * cold, "cached_us": 1e6 * (time.perf_counter() - t0)}
    return out, cache, cfg


def masking_cost(cache, cfg, rows: int, repeats: int) -> dict:
    """Per step at `rows` running, all constrained (one matcher per row, a mix of the schemas, each a few tokens
    into its output), against greedy sampling of the same logits."""
    from common.structured_outputs import Constraint
    from worker_svc.sampling.grammar import GrammarMasks
    from worker_svc.sampling.sampler import greedy_batch

    names = list(SCHEMAS)
    masks = GrammarMasks(cfg.vocab_size)
    matchers = [cache.matcher(Constraint("json_schema", json.dumps(SCHEMAS[names[i % len(names)]])),
                              np.zeros(0, dtype=np.int64)) for i in range(rows)]
    gen = torch.Generator().manual_seed(0)
    mask_s, advance_s, greedy_s = [], [], []
    for _ in range(repeats):
        logits = torch.randn(rows, cfg.vocab_size, generator=gen)
        t0 = time.perf_counter()
        greedy_batch(logits)
        greedy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        masks.apply(logits, matchers)
        t1 = time.perf_counter()
        tokens = greedy_batch(logits).token_ids
        t2 = time.perf_counter()
        ended = masks.advance(matchers, tokens)
        advance_s.append(time.perf_counter() - t2)
        mask_s.append(t1 - t0)
        for i in np.flatnonzero(ended).tolist():  # a finished row starts over
            matchers[i] = cache.matcher(Constraint("json_schema", json.dumps(SCHEMAS[names[i % len(names)]])),
                                        np.zeros(0, dtype=np.int64))
    med = lambda xs: 1000 * percentile(xs, 50)  # noqa: E731
    return {"rows": rows, "mask_ms_p50": med(mask_s), "advance_ms_p50": med(advance_s),
            "greedy_sample_ms_p50": med(greedy_s),
            "ratio_vs_greedy": (med(mask_s) + med(advance_s)) / med(greedy_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32, help="constrained requests (and as many unconstrained)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=64, help="running requests for the masking cost")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    compiled, cache, cfg = compile_times()
    print(json.dumps(compiled, indent=1))
    masking = masking_cost(cache, cfg, args.rows, args.repeats)
    print(json.dumps(masking, indent=1))
    result = {"compile": compiled, "masking": masking}
    if not args.skip_serving:
        result["serving"] = serving(args.num_requests, args.max_tokens)
        print(json.dumps(result["serving"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
