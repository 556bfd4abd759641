"""Speculative decoding: no speculation, n-gram prompt lookup, a draft model and an eagle3 / mtp head in the same run,
batch 1 and 16.

The stack: a private redis-server and worker processes (bundled SmolLM2-135M GGUF unless --model): one plain
worker for `none` and `ngram`, one more per draft model (a draft runs over every token its worker computes, so it
gets its own worker); per run a fresh in-process scheduler in its own Redis namespace (`--speculative-config` or
none; one scheduler drives a worker at a time). The methods (--methods) alternate `--repeats` times; each run sends
one unmeasured warm-up request first. `draft_model` drafts with --draft-model (default: the model itself, the
upper bound of acceptance; its cost is a second copy of the model's forwards). `eagle3` drafts with --eagle3-head
(or --random-eagle3-head: a random-weight head for the bundled model, which measures the cost, not the gain) and
`mtp` with the checkpoint's own MTP layers (a Qwen3.5 / Qwen3-Next --model); each head loads in its own worker.
`draft_random` (not in the default --methods) drafts with a random-weight 2-layer Llama of the model's vocabulary
and tokenizer, written to the run's temporary directory: the lower bound, what drafting costs when almost nothing
is accepted.

Workloads (temperature 0, so both sides compute the same tokens):
- repetitive: chat requests "rename this function, reply with the complete code" over small Python modules
  (distinct per request), ending at EOS (at most --repetitive-tokens): the answer largely copies the prompt, the
  case prompt lookup exists for.
- chat: llmserve.bench.workloads' `chat` (random-token prompts of 32..256 tokens, fixed outputs of 32..128 with
  `ignore_eos`).
- prose: plain questions ("Why is the sky blue?"), ending at EOS (at most --repetitive-tokens): the answer copies
  little of the prompt, so prompt lookup finds little; what a learned head (eagle3) is for.

With an eagle3 / mtp `--speculative-config` the "on" runs go to a second worker process started with the flag (the
head loaded; the "off" worker has none, so the head's cost per step counts); `--random-eagle3-head` writes a
random-weight EAGLE-3 head for the bundled model and uses it (acceptance ~0: what it measures is the overhead).

Batch 1 sends the requests one after another; batch 16 sends 16 at once. Reported per run: output tokens/s (all
output tokens / wall time of the wave), TPOT (per request: (last token - first token) / (tokens - 1), median),
acceptance rate (vllm:spec_decode_num_accepted_tokens_total / ..._num_draft_tokens_total), accepted tokens per
draft run and the per-position acceptance (vllm:spec_decode_num_accepted_tokens_per_pos_total{position} /
drafts); the speed-up is the median method/none throughput ratio over the repeats. Greedy outputs with
speculation must equal none's (reported as "identical k/N").

    .venv/bin/python -m experiments.speculative                        # the three workloads, batch 1 and 16
    .venv/bin/python -m experiments.speculative --only repetitive --batches 1 --repeats 1
    .venv/bin/python -m experiments.speculative --methods none,draft_model --draft-model DIR
    .venv/bin/python -m experiments.speculative --methods none,draft_model,draft_random --only repetitive
    .venv/bin/python -m experiments.speculative --json out.json
    .venv/bin/python -m experiments.speculative --only chat --methods none,eagle3 --random-eagle3-head --repeats 1
    .venv/bin/python -m experiments.speculative --only prose --methods none,ngram,eagle3 \
        --eagle3-head experiments/out/eagle3/head                     # the head experiments/train_eagle3.py wrote

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
from worker_svc.model.loader import default_model_path

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


# Questions in plain prose (none of them among experiments/train_eagle3.py's training prompts): the answer copies
# little of the prompt, so prompt lookup has little to find; the case a learned head is for.
_QUESTIONS = ["How do airplanes stay in the air?", "What is the difference between weather and climate?",
              "Give me some tips for a job interview.", "Why do cats purr?", "How does a refrigerator keep food cold?",
              "What causes the seasons on Earth?", "Write a short story about a lost dog finding its way home.",
              "How can I learn a new language faster?", "What is inflation and why does it happen?",
              "Explain how a rainbow forms.", "What are the benefits of regular exercise?",
              "Describe a typical day of a farmer.", "Why is the sky blue?", "How do vaccines train the body?",
              "Write a letter thanking a teacher.", "What makes a good friend?"]


def prose_prompts(n: int) -> list[list[tuple[str, str]]]:
    return [[("user", _QUESTIONS[i % len(_QUESTIONS)])] for i in range(n)]


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


def _spec_counts(driver) -> tuple[float, float, float, list[float]]:
    """drafts, draft tokens, accepted, accepted per draft position: the vllm:spec_decode_* counters /metrics serves."""
    m = driver.metrics
    return (*(c._value.get() for c in m.c_spec), [c._value.get() for c in m.c_spec_pos])


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
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3], strict=True))
    per_pos = [a - (before[3][j] if j < len(before[3]) else 0) for j, a in enumerate(after[3])]
    n_out = sum(len(s["tokens"]) for s in streams)
    tpots = [s["tpot_s"] for s in streams if s["tpot_s"] is not None]
    return {"spec": bool(spec), "batch": batch, "output_tokens": n_out, "wall_s": wall,
            "tokens_per_s": n_out / wall, "tpot_ms_median": 1000 * statistics.median(tpots) if tpots else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "accepted_per_draft_run": accepted / drafts if drafts else None,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            # vLLM's per-position acceptance rate: accepted at draft position j / draft runs.
            "acceptance_per_pos": [n / drafts for n in per_pos] if drafts else [],
            "outputs": [s["tokens"] for s in streams]}


def random_draft(target: str, path: str) -> str:
    """A random-weight Llama of the target's vocabulary and tokenizer (2 layers, hidden 192): what drafting costs
    when almost nothing is accepted."""
    import torch
    import transformers

    from common.tokenizer import load_tokenizer
    from worker_svc.model.loader import load_model_weights

    cfg, _ = load_model_weights(target)
    config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=192, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                                      max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(target).backend.save(f"{path}/tokenizer.json")
    return path


OWN_WORKER = ("draft_model", "draft_random", "eagle3", "mtp")  # the proposer loads in the worker: one worker per method


def _spec_of(method: str, a: argparse.Namespace, drafts: dict[str, str]) -> str | None:
    if method == "none":
        return None
    if method == "ngram":
        return a.speculative_config
    model = {**drafts, "eagle3": a.eagle3_head}.get(method)
    kind = "draft_model" if method == "draft_random" else method
    return json.dumps({"method": kind, **({"model": model} if model else {}),
                       "num_speculative_tokens": a.num_speculative_tokens})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC, help="the ngram method's flag")
    ap.add_argument("--methods", default="none,ngram,draft_model",
                    help="comma-separated: none, ngram, draft_model, draft_random (a random-weight 2-layer draft), "
                    "eagle3, mtp")
    ap.add_argument("--draft-model", default=None, help="draft_model's model (default: --model itself)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k of draft_model, eagle3 and mtp")
    ap.add_argument("--only", default=None,
                    help="comma-separated workloads of repetitive, chat, prose (default: all three)")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests of a batch-1 wave (sent one by one)")
    ap.add_argument("--repetitive-tokens", type=int, default=128,
                    help="output tokens of a repetitive or prose request (at most: they end at EOS)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the full results here")
    ap.add_argument("--eagle3-head", default=None, help="eagle3's head directory")
    ap.add_argument("--random-eagle3-head", action="store_true",
                    help="eagle3 with a random-weight EAGLE-3 head for the bundled model")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    methods = a.methods.split(",")
    workloads = a.only.split(",") if a.only else ["repetitive", "chat", "prose"]
    if set(workloads) - {"repetitive", "chat", "prose"}:
        ap.error(f"--only {a.only!r}: workloads are repetitive, chat and prose")
    worker_args = ["--max-model-len", 2048] + (["--model", a.model] if a.model else [])
    workdir = tempfile.mkdtemp(prefix="bench-spec-")
    redis = processes.start_redis(f"{workdir}/redis", wait=False)
    drafts = {"draft_model": a.draft_model or a.model or default_model_path()}
    if "draft_random" in methods:
        drafts["draft_random"] = random_draft(a.model or default_model_path(), f"{workdir}/random-draft")
    if a.random_eagle3_head:
        from tests.support.spec_heads import bundled_model_dims, write_eagle3_head

        a.eagle3_head = write_eagle3_head(f"{workdir}/eagle3", aux_layers=None, dims=bundled_model_dims(),
                                          draft_vocab=2048)
    workers = {"none": processes.start_worker(worker_args, log_dir=workdir, wait=False)}
    workers["ngram"] = workers["none"]
    for m in OWN_WORKER:
        if m in methods:
            workers[m] = processes.start_worker([*worker_args, "--speculative-config", _spec_of(m, a, drafts)],
                                                log_dir=f"{workdir}/{m}", wait=False)
    processes.wait_ready(redis)
    for w in set(workers.values()):
        processes.wait_ready(w, timeout=600)
    report: dict = {"methods": {m: _spec_of(m, a, drafts) for m in methods}, "runs": []}
    try:
        for workload in workloads:
            for batch in batches:
                n = a.batch1_requests if batch == 1 else batch
                if workload in ("repetitive", "prose"):
                    made = repetitive_prompts(n) if workload == "repetitive" else prose_prompts(n)
                    items = [(p, a.repetitive_tokens) for p in made]
                else:
                    items = chat_prompts(n, a.seed)
                ratios: dict[str, list[float]] = {m: [] for m in methods if m != "none"}
                same: dict[str, int] = dict.fromkeys(ratios, 0)
                for rep in range(a.repeats):
                    runs = {m: run_once(redis.url, workers[m], items, batch, _spec_of(m, a, drafts),
                                        a.max_num_batched_tokens) for m in ["none", *ratios]}
                    off = runs["none"]
                    line = f"{workload:10s} batch {batch:2d} rep {rep}: none {off['tokens_per_s']:6.1f} tok/s"
                    for m, on in runs.items():
                        on.update(workload=workload, repeat=rep, method=m)
                        report["runs"].append({k: v for k, v in on.items() if k != "outputs"})
                        if m == "none":
                            continue
                        ratios[m].append(on["tokens_per_s"] / off["tokens_per_s"])
                        same[m] += sum(x == y for x, y in zip(off["outputs"], on["outputs"], strict=True))
                        acc = on["acceptance_rate"]
                        line += (f" | {m} {on['tokens_per_s']:6.1f} tok/s, acceptance "
                                 f"{'-' if acc is None else f'{100 * acc:.0f}%'}, "
                                 f"{on['accepted_per_draft_run'] or 0:.2f}/run, per position "
                                 f"{'/'.join(f'{100 * r:.0f}' for r in on['acceptance_per_pos']) or '-'}%, "
                                 f"{ratios[m][-1]:.2f}x")
                    print(line, flush=True)
                for m in ratios:
                    summary = {"workload": workload, "batch": batch, "method": m,
                               "speedup_median": statistics.median(ratios[m]), "ratios": ratios[m],
                               "identical": f"{same[m]}/{a.repeats * len(items)}"}
                    report.setdefault("summary", []).append(summary)
                    print(f"== {workload} batch {batch} {m}: throughput vs none {summary['speedup_median']:.2f}x "
                          f"(median of {len(ratios[m])}), greedy outputs identical {summary['identical']}",
                          flush=True)
    finally:
        for w in set(workers.values()):
            processes.stop(w)
        processes.stop(redis)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
