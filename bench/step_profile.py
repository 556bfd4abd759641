"""Single worker steps on the bundled model (the profile in bench/RESULTS.md): 56 decodes; a 1,536-token prompt
whole vs in chunks, alone and next to the decodes; and the Hugging Face forward of the same prompt.

    .venv/bin/python bench/step_profile.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from protos import worker_pb2 as pb  # noqa: E402
from worker_svc.loader import default_model_path  # noqa: E402
from worker_svc.runner import ModelRunner, RunnerOptions  # noqa: E402

NUM_BLOCKS, BLOCK, DECODES, LONG = 4096, 16, 56, 1536


class Steps:
    def __init__(self) -> None:
        self.runner = ModelRunner(RunnerOptions(model=default_model_path(), num_gpu_blocks_override=NUM_BLOCKS))
        self.free = list(range(NUM_BLOCKS))
        self.step_id = 0
        self.sampling = pb.SamplingParams(max_tokens=1000, temperature=0)

    def blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def run(self, label: str, plan: pb.StepPlan) -> None:
        self.step_id += 1
        plan.step_id = self.step_id
        t = time.perf_counter()
        self.runner.execute(plan)
        print(f"{label:<44} {time.perf_counter() - t:6.3f} s", flush=True)

    def new(self, plan: pb.StepPlan, rid: str, prompt: list[int], n: int) -> None:
        plan.new_requests.add(request_id=rid, prompt_token_ids=prompt, sampling=self.sampling,
                              block_ids=self.blocks(-(-(len(prompt) + 64) // BLOCK)), num_scheduled_tokens=n)

    def decodes(self) -> pb.StepPlan:
        plan = pb.StepPlan()
        for i in range(DECODES):
            plan.cached_requests.add(request_id=f"d{i}", num_scheduled_tokens=1)
        return plan

    @staticmethod
    def more(plan: pb.StepPlan, rid: str, n: int) -> pb.StepPlan:
        plan.cached_requests.add(request_id=rid, num_scheduled_tokens=n)
        return plan


def main() -> None:
    torch.set_num_threads(2)
    s = Steps()
    plan = pb.StepPlan()
    for i in range(DECODES):
        s.new(plan, f"d{i}", [(i * 7 + j) % 900 + 20 for j in range(200)], 200)
    s.run(f"prefill {DECODES} x 200 (warm-up)", plan)
    for _ in range(2):
        s.run(f"{DECODES} decodes, 200-token contexts", s.decodes())
    prompt = [(j * 13) % 900 + 20 for j in range(LONG)]
    plan = pb.StepPlan()
    s.new(plan, "whole", prompt, LONG)
    s.run(f"{LONG}-token prompt alone, whole", plan)
    plan = pb.StepPlan()
    s.new(plan, "chunks", prompt, 512)
    s.run("  alone, chunk 1 of 512", plan)
    s.run("  alone, chunk 2 of 512", s.more(pb.StepPlan(), "chunks", 512))
    s.run("  alone, chunk 3 of 512", s.more(pb.StepPlan(), "chunks", 512))
    plan = s.decodes()
    s.new(plan, "mixed", prompt, 456)
    s.run(f"{DECODES} decodes + chunk 1 of 456", plan)
    s.run(f"{DECODES} decodes + chunk 2 of 456", s.more(s.decodes(), "mixed", 456))
    s.run(f"{DECODES} decodes + chunk 3 of 456", s.more(s.decodes(), "mixed", 456))
    plan = s.decodes()
    s.new(plan, "stall", prompt, LONG)
    s.run(f"{DECODES} decodes + the whole prompt", plan)

    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(2):
            t = time.perf_counter()
            hf(ids, use_cache=True, logits_to_keep=1)
            print(f"{'Hugging Face forward of the prompt':<44} {time.perf_counter() - t:6.3f} s", flush=True)


if __name__ == "__main__":
    main()
