"""The cost of rolling rejected n-gram drafts back out of a hybrid model's recurrent state, measured end to end:
one real worker on a random-weight Qwen3.5 (experiments.hybrid_serving's checkpoint), redis-server, and one
scheduler without speculation then one with `--speculative-config` ngram, on the same worker in the same run.

Each mode serves the same batch of greedy requests on repetitive prompts (a pattern of `--period` tokens repeated),
all sent at once, and reports the wall time, the generated tokens per second and, with speculation, the drafted and
accepted draft tokens (every step where a sequence's drafts are not all accepted runs one roll-back forward over the
accepted rows of those sequences: worker_svc/core/draft_rollback.py). Both modes must give the same tokens.

    PYTHONPATH=$PWD .venv/bin/python -m experiments.hybrid_rollback_cost
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

from experiments.hybrid_serving import VOCAB, write_checkpoint
from llmserve import processes
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.e2e.test_prefix_cache import metrics

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
DRAFTED, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"


def generate(address: str, ids: list[int], max_tokens: int) -> list[int]:
    req = pb.GenerateRequest(request_id=uuid.uuid4().hex[:8],
                             sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
    req.token_ids.SetInParent()
    req.token_ids.ids.extend(ids)
    out: list[int] = []
    with grpc.insecure_channel(address) as channel:
        for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=900):
            out.extend(msg.token_ids)
    return out


def serve(redis_url: str, worker: processes.Proc, flags: list, prompts: list[list[int]], max_tokens: int):
    """(seconds for the whole batch, outputs, {metric: value}) through a fresh scheduler with `flags`."""
    port = processes.free_port()
    sched = processes.start_scheduler(redis_url, worker, ["--metrics-port", port, "--no-enable-prefix-caching",
                                                          *flags],
                                      namespace=processes.new_namespace("hybrid-rollback"))
    try:
        processes.wait_healthy(sched.address, timeout=180, proc=sched)
        generate(sched.address, [1, 2, 3], 2)  # warm-up
        before = metrics(port)
        outs: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: outs.__setitem__(i, generate(sched.address, p,
                                                                                         max_tokens)))
                   for i, p in enumerate(prompts)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        after = metrics(port)
        counts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (DRAFTED, ACCEPTED)}
        return seconds, [outs[i] for i in range(len(prompts))], counts
    finally:
        processes.stop(sched)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--period", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    prompts = [[(7 * i + 3 * k + 11) % VOCAB for k in range(args.period)] * (args.prompt_len // args.period)
               for i in range(args.batch)]
    with tempfile.TemporaryDirectory(prefix="hybrid-rollback-") as tmp:
        path = Path(tmp) / "qwen3_5"
        write_checkpoint("qwen3_5", path, args.layers, args.hidden, 1024)
        redis = processes.start_redis(str(Path(tmp) / "redis"))
        worker = processes.start_worker(["--model", str(path), "--dtype", "float32", "--max-model-len", 1024])
        try:
            base_s, base_out, _ = serve(redis.url, worker, [], prompts, args.max_tokens)
            spec_s, spec_out, counts = serve(redis.url, worker, ["--speculative-config", SPEC], prompts,
                                             args.max_tokens)
        finally:
            processes.stop(worker)
            processes.stop(redis)
    tokens = args.batch * args.max_tokens
    print(f"Qwen3.5 random, {args.layers} layers, hidden {args.hidden}, float32; {args.batch} requests x "
          f"{args.prompt_len}-token repetitive prompt (period {args.period}) x {args.max_tokens} greedy tokens")
    print(f"same tokens: {base_out == spec_out}")
    print(f"no speculation : {base_s:6.2f} s  {tokens / base_s:6.1f} tok/s")
    print(f"ngram (k=3)    : {spec_s:6.2f} s  {tokens / spec_s:6.1f} tok/s  drafted {counts[DRAFTED]:.0f} accepted "
          f"{counts[ACCEPTED]:.0f} ({counts[ACCEPTED] / max(counts[DRAFTED], 1):.0%})")


if __name__ == "__main__":
    main()
