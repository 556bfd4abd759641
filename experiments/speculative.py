"""Speculative decoding (n-gram prompt lookup, or an eagle3 / mtp head): speculation on versus off in the same run,
batch 1 and 16.

The stack: a private redis-server and one worker process (bundled SmolLM2-135M GGUF unless --model); per run a
fresh in-process scheduler in its own Redis namespace (`--speculative-config` or none; one scheduler drives the
worker at a time). Runs alternate off/on `--repeats` times; each run sends one unmeasured warm-up request first.

Workloads (temperature 0, so both sides compute the same tokens):
- repetitive: chat requests "rename this function, reply with the complete code" over small Python modules
  (distinct per request), ending at EOS (at most --repetitive-tokens): the answer largely copies the prompt, the
  case prompt lookup exists for.
- chat: llmserve.bench.workloads' `chat` (random-token prompts of 32..256 tokens, fixed outputs of 32..128 with
  `ignore_eos`).

With an eagle3 / mtp `--speculative-config` the "on" runs go to a second worker process started with the flag (the
head loaded; the "off" worker has none, so the head's cost per step counts); `--random-eagle3-head` writes a
random-weight EAGLE-3 head for the bundled model and uses it (acceptance ~0: what it measures is the overhead).

Batch 1 sends the requests one after another; batch 16 sends 16 at once. Reported per run: output tokens/s (all
output tokens / wall time of the wave), TPOT (per request: (last token - first token) / (tokens - 1), median),
acceptance rate (vllm:spec_decode_num_accepted_tokens_total / ..._num_draft_tokens_total) and accepted tokens per
draft run; the speed-up is the median on/off throughput ratio over the repeats. Greedy outputs with speculation on
must equal off (reported as "identical k/N").

    .venv/bin/python -m experiments.speculative                        # both workloads, batch 1 and 16
    .venv/bin/python -m experiments.speculative --only repetitive --batches 1 --repeats 1
    .venv/bin/python -m experiments.speculative --json out.json
    .venv/bin/python -m experiments.speculative --only chat --random-eagle3-head --repeats 1

Results and commands: experiments/RESULTS.md (speculative decoding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import uuid

from llmserve import client, processes
from llmserve.bench.workloads import WorkloadParams, generate
from protos import llmserve_pb2 as pb
from tests.support.stack import start_scheduler_in_process

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
_MODULE = '''import os


def {name}(path, {arg}):
    """Read every line of path and keep those that contain {arg}."""
    kept = []
    with open(path) as f:
        for line in f:
            if {arg} in line:
                kept.append(line.rstrip())
    return kept


def count_{name}(path, {arg}):
    return len({name}(path, {arg}))


if __name__ == "__main__":
    print(count_{name}(os.environ["FILE"], "{word}"))
'''
_NAMES = ["grep_lines", "find_rows", "select_text", "match_file", "pick_lines", "filter_log", "scan_words",
          "search_doc", "keep_hits", "read_hits", "lines_with", "take_rows", "grab_text", "show_hits", "list_rows",
          "gather_lines"]


def _module(i: int) -> str:
    name, arg = _NAMES[i % len(_NAMES)], ["needle", "term", "pattern", "key"][i % 4]
    return _MODULE.format(name=name, arg=arg, word=f"w{i}")


def repetitive_prompts(n: int) -> list[list[tuple[str, str]]]:
    """Chat requests asking for a module back with one function renamed: the answer largely copies the prompt."""
    out = []
    for i in range(n):
        name = _NAMES[i % len(_NAMES)]
        out.append([("user", f"Rename the function {name} to {name}_v2. Reply with the complete code only.\n\n"
                             f"```python\n{_module(i)}```")])
    return out


def chat_prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    specs = generate("chat", WorkloadParams(num_requests=n, seed=seed))
    return [(list(s.prompt_ids), s.max_tokens) for s in specs]


def _request(prompt, max_tokens: int) -> pb.GenerateRequest:
    """Chat prompts (the repetitive workload) end at EOS, as a real answer does; token prompts ignore it."""
    chat = isinstance(prompt[0], tuple)
    req = pb.GenerateRequest(request_id=f"bench-{uuid.uuid4().hex[:10]}",
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not chat))
    if isinstance(prompt, str):
        req.text = prompt
    elif chat:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in prompt)
    else:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    return req


def _stream(address: str, prompt, max_tokens: int) -> dict:
    t0, times = time.perf_counter(), []

    def arrived(m: pb.GenerateResponse) -> None:
        if m.token_ids:
            times.append(time.perf_counter())

    tokens = client.stream(_request(prompt, max_tokens), address, on_message=arrived).token_ids[0]
    tpot = (times[-1] - times[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"tokens": tokens, "tpot_s": tpot, "start": t0, "end": times[-1] if times else t0}


def _wave(address: str, items: list[tuple[object, int]], batch: int) -> tuple[list[dict], float]:
    """Send `items` `batch` at a time (each group waits for the previous one); returns the streams and wall time."""
    results: list[dict | None] = [None] * len(items)
    t0 = time.perf_counter()
    for start in range(0, len(items), batch):
        group = list(range(start, min(start + batch, len(items))))
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream(address, *items[i])))
                   for i in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results, time.perf_counter() - t0


def _spec_counts(driver) -> tuple[float, float, float]:
    m = driver.metrics
    return tuple(c._value.get() for c in m.c_spec)  # drafts, draft tokens, accepted


def run_once(redis_url: str, worker, items, batch: int, spec: str | None, budget: int) -> dict:
    args = ["--namespace", f"bench-spec-{uuid.uuid4().hex[:8]}", "--max-num-batched-tokens", budget]
    if spec:
        args += ["--speculative-config", spec]
    sched = start_scheduler_in_process(redis_url, worker, args)
    try:
        _stream(sched.address, "Warm up.", 4)  # loads the detokenizer
        before = _spec_counts(sched.driver)
        streams, wall = _wave(sched.address, items, batch)
        after = _spec_counts(sched.driver)
    finally:
        sched.stop()
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
    n_out = sum(len(s["tokens"]) for s in streams)
    tpots = [s["tpot_s"] for s in streams if s["tpot_s"] is not None]
    return {"spec": bool(spec), "batch": batch, "output_tokens": n_out, "wall_s": wall,
            "tokens_per_s": n_out / wall, "tpot_ms_median": 1000 * statistics.median(tpots) if tpots else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "accepted_per_draft_run": accepted / drafts if drafts else None,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted, "outputs": [s["tokens"] for s in streams]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--only", choices=["repetitive", "chat"], default=None)
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests of a batch-1 wave (sent one by one)")
    ap.add_argument("--repetitive-tokens", type=int, default=128, help="output tokens of a repetitive request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the full results here")
    ap.add_argument("--random-eagle3-head", action="store_true",
                    help="speculate with a random-weight EAGLE-3 head for the bundled model (k = 3)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    workloads = [a.only] if a.only else ["repetitive", "chat"]
    worker_args = ["--max-model-len", 2048] + (["--model", a.model] if a.model else [])
    workdir = tempfile.mkdtemp(prefix="bench-spec-")
    redis = processes.start_redis(f"{workdir}/redis", wait=False)
    worker = processes.start_worker(worker_args, log_dir=workdir, wait=False)
    if a.random_eagle3_head:
        from tests.support.spec_heads import bundled_model_dims, write_eagle3_head

        head = write_eagle3_head(f"{workdir}/eagle3", aux_layers=None, dims=bundled_model_dims(), draft_vocab=2048)
        a.speculative_config = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    worker_on = worker
    if json.loads(a.speculative_config).get("method") in ("eagle3", "mtp"):  # the head loads in the worker
        worker_on = processes.start_worker([*worker_args, "--speculative-config", a.speculative_config],
                                           log_dir=workdir, wait=False)
    processes.wait_ready(redis)
    processes.wait_ready(worker, timeout=300)
    processes.wait_ready(worker_on, timeout=300)
    report: dict = {"speculative_config": a.speculative_config, "runs": []}
    try:
        for workload in workloads:
            for batch in batches:
                n = a.batch1_requests if batch == 1 else batch
                if workload == "repetitive":
                    items = [(p, a.repetitive_tokens) for p in repetitive_prompts(n)]
                else:
                    items = chat_prompts(n, a.seed)
                ratios, same, total = [], 0, 0
                for rep in range(a.repeats):
                    off = run_once(redis.url, worker, items, batch, None, a.max_num_batched_tokens)
                    on = run_once(redis.url, worker_on, items, batch, a.speculative_config,
                                  a.max_num_batched_tokens)
                    ratios.append(on["tokens_per_s"] / off["tokens_per_s"])
                    same += sum(x == y for x, y in zip(off["outputs"], on["outputs"], strict=True))
                    total += len(items)
                    for r in (off, on):
                        r.update(workload=workload, repeat=rep)
                        report["runs"].append({k: v for k, v in r.items() if k != "outputs"})
                    acc = on["acceptance_rate"]
                    print(f"{workload:10s} batch {batch:2d} rep {rep}: off {off['tokens_per_s']:6.1f} tok/s "
                          f"TPOT {off['tpot_ms_median']:6.1f} ms | on {on['tokens_per_s']:6.1f} tok/s TPOT "
                          f"{on['tpot_ms_median']:6.1f} ms, acceptance "
                          f"{'-' if acc is None else f'{100 * acc:.0f}%'}, "
                          f"{on['accepted_per_draft_run'] or 0:.2f} accepted/run | ratio {ratios[-1]:.2f}x",
                          flush=True)
                summary = {"workload": workload, "batch": batch, "speedup_median": statistics.median(ratios),
                           "ratios": ratios, "identical": f"{same}/{total}"}
                report.setdefault("summary", []).append(summary)
                print(f"== {workload} batch {batch}: on/off throughput {summary['speedup_median']:.2f}x (median of "
                      f"{len(ratios)}), greedy outputs identical {same}/{total}", flush=True)
    finally:
        processes.stop(worker)
        if worker_on is not worker:
            processes.stop(worker_on)
        processes.stop(redis)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
