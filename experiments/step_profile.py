"""Single worker steps on the bundled model (the profile in experiments/RESULTS.md): 56 decodes; a 1,536-token prompt
whole vs in chunks, alone and next to the decodes; and the Hugging Face forward of the same prompt.

    .venv/bin/python -m experiments.step_profile
    .venv/bin/python -m experiments.step_profile --smoke    # 4 decodes, a 96-token prompt: the same steps in seconds

`--peer-load N` times instead the steps of the peer benchmark's load at concurrency N, alone (no HTTP, no scheduler,
no other process): N prompts of 128 tokens prefilled 512 tokens a step (the CPU token budget), then decode steps of
the N; it prints the median step of each kind and what the load's steps add up to (a wave of N requests runs
ceil(128 N / 512) prefill steps and 63 decode steps).

    .venv/bin/python -m experiments.step_profile --peer-load 64 [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from protos import worker_pb2 as pb
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.loader import default_model_path
from worker_svc.server import execute_step

BLOCK = 16


class Steps:
    def __init__(self, num_blocks: int, dtype: str = "auto") -> None:
        self.runner = ModelRunner(WorkerConfig(model=default_model_path(), num_gpu_blocks_override=num_blocks,
                                               dtype=dtype))
        self.free = list(range(num_blocks))
        self.slot_of: dict[str, int] = {}  # the worker protocol addresses requests by slot
        self.step_id = 0
        self.sampling = pb.SamplingParams(max_tokens=1000, temperature=0)

    def blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def timed(self, plan: pb.StepPlan) -> float:
        """Seconds the worker takes for one step."""
        self.step_id += 1
        plan.step_id = self.step_id
        t = time.perf_counter()
        execute_step(self.runner, plan)
        return time.perf_counter() - t

    def run(self, label: str, plan: pb.StepPlan) -> None:
        print(f"{label:<44} {self.timed(plan):6.3f} s", flush=True)

    def new(self, plan: pb.StepPlan, rid: str, prompt: list[int], n: int) -> None:
        slot = self.slot_of.setdefault(rid, len(self.slot_of))
        plan.new_requests.add(slot=slot, request_id=rid, prompt_token_ids=prompt, sampling=self.sampling,
                              block_ids=self.blocks(-(-(len(prompt) + 64) // BLOCK)), num_scheduled_tokens=n)

    def decodes(self, n: int) -> pb.StepPlan:
        plan = pb.StepPlan()
        plan.cached.slots.extend(self.slot_of[f"d{i}"] for i in range(n))
        plan.cached.num_scheduled_tokens.extend([1] * n)
        return plan

    def more(self, plan: pb.StepPlan, rid: str, n: int) -> pb.StepPlan:
        plan.cached.slots.append(self.slot_of[rid])
        plan.cached.num_scheduled_tokens.append(n)
        return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="4 decodes of 32-token contexts and a 96-token prompt")
    ap.add_argument("--peer-load", type=int, default=None, metavar="N",
                    help="the steps of the peer benchmark's load at concurrency N instead (see above)")
    ap.add_argument("--dtype", default="auto", help="the worker's --dtype (auto, float32, bfloat16)")
    args = ap.parse_args()
    if args.peer_load:
        peer_load(args.peer_load, args.smoke, args.dtype)
        return
    decodes, context, long = (4, 32, 96) if args.smoke else (56, 200, 1536)
    chunk, mixed = -(-long // 3), long * 19 // 64  # 512 and 456 for the 1,536-token prompt
    torch.set_num_threads(2)
    s = Steps(128 if args.smoke else 4096, args.dtype)
    plan = pb.StepPlan()
    for i in range(decodes):
        s.new(plan, f"d{i}", [(i * 7 + j) % 900 + 20 for j in range(context)], context)
    s.run(f"prefill {decodes} x {context} (warm-up)", plan)
    for _ in range(2):
        s.run(f"{decodes} decodes, {context}-token contexts", s.decodes(decodes))
    prompt = [(j * 13) % 900 + 20 for j in range(long)]
    plan = pb.StepPlan()
    s.new(plan, "whole", prompt, long)
    s.run(f"{long}-token prompt alone, whole", plan)
    plan = pb.StepPlan()
    s.new(plan, "chunks", prompt, chunk)
    s.run(f"  alone, chunk 1 of {chunk}", plan)
    s.run(f"  alone, chunk 2 of {chunk}", s.more(pb.StepPlan(), "chunks", chunk))
    s.run(f"  alone, chunk 3 of {chunk}", s.more(pb.StepPlan(), "chunks", long - 2 * chunk))
    plan = s.decodes(decodes)
    s.new(plan, "mixed", prompt, mixed)
    s.run(f"{decodes} decodes + chunk 1 of {mixed}", plan)
    s.run(f"{decodes} decodes + chunk 2 of {mixed}", s.more(s.decodes(decodes), "mixed", mixed))
    s.run(f"{decodes} decodes + chunk 3 of {mixed}", s.more(s.decodes(decodes), "mixed", mixed))
    plan = s.decodes(decodes)
    s.new(plan, "stall", prompt, long)
    s.run(f"{decodes} decodes + the whole prompt", plan)

    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(2):
            t = time.perf_counter()
            hf(ids, use_cache=True, logits_to_keep=1)
            print(f"{'Hugging Face forward of the prompt':<44} {time.perf_counter() - t:6.3f} s", flush=True)


def peer_load(n: int, smoke: bool, dtype: str) -> None:
    prompt_len, budget, outputs, timed = (16, 64, 4, 2) if smoke else (128, 512, 64, 20)
    torch.set_num_threads(2)
    s = Steps(n * -(-(prompt_len + 64) // BLOCK) + 8, dtype)  # Steps.new gives each prompt room for 64 more tokens
    prefills, pending, plan, room = [], [f"p{i}" for i in range(n)], pb.StepPlan(), budget
    while pending:  # whole prompts, as many as the budget holds, as the scheduler packs a wave's first steps
        rid = pending.pop(0)
        i = int(rid[1:])
        s.new(plan, rid, [(i * 7919 + j * 13) % 900 + 20 for j in range(prompt_len)], prompt_len)
        room -= prompt_len
        if room < prompt_len or not pending:
            prefills.append(s.timed(plan))
            plan, room = pb.StepPlan(), budget
    decodes = []
    for _ in range(timed):
        plan = pb.StepPlan()
        plan.cached.slots.extend(s.slot_of[f"p{i}"] for i in range(n))
        plan.cached.num_scheduled_tokens.extend([1] * n)
        decodes.append(s.timed(plan))
    pre, dec = statistics.median(prefills), statistics.median(decodes)
    wave = len(prefills) * pre + (outputs - 1) * dec
    print(f"{len(prefills)} prefill steps of up to {budget} tokens: median {pre * 1e3:.1f} ms")
    print(f"decode steps of {n}: median {dec * 1e3:.1f} ms (of {timed})")
    print(f"a wave of {n} requests: {wave:.2f} s, {n * outputs / wave:.0f} output tokens/s from the steps alone")


if __name__ == "__main__":
    main()
