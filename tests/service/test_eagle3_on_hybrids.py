"""EAGLE-3 on hybrid targets (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2; random-weight checkpoints
transformers wrote here) on the worker's runner, in process: the head reads the residual stream entering the layers
its config names, whatever their kind, and every rejected draft is rolled back out of the recurrent state
(worker_svc/core/draft_rollback.py). Greedy output equals plain decoding's with chunked prefill; with random weights
most drafts are rejected, so the roll-back is what keeps it exact."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest

from protos import worker_pb2 as pb
from tests.support.driver import DriverRequest, run_requests
from tests.support.spec_heads import write_eagle3_head
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.server import execute_step

K = 3
DIMS = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 96, "vocab": 320}
AUX = {"qwen3_5": (0, 1, 3), "nemotron_h": (0, 2, 4)}  # the last index: the final layer's output


@pytest.fixture(scope="module", params=list(AUX))
def runners(request, tmp_path_factory):
    from tests.service.test_hybrid_families import make_checkpoint

    root = tmp_path_factory.mktemp(f"eagle3-{request.param}")
    make_checkpoint(request.param, str(root / "target"))
    head = write_eagle3_head(str(root / "head"), aux_layers=AUX[request.param], dims=DIMS, draft_vocab=160)
    opts = dict(model=str(root / "target"), dtype="float32", num_gpu_blocks_override=128, num_state_slots=8)
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": K})
    return ModelRunner(WorkerConfig(**opts)), ModelRunner(WorkerConfig(**opts, speculative_config=spec))


def requests(tag: str, prompts: list[list[int]]) -> list[DriverRequest]:
    params = pb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [DriverRequest(f"{tag}-{i}", ids, params, arrival_step=i % 3) for i, ids in enumerate(prompts)]


@pytest.mark.parametrize("chunk", [7, 64])
def test_greedy_with_eagle3_on_a_hybrid_equals_plain_decoding(runners, chunk):
    plain, eagle = runners
    assert eagle.heads is not None and eagle.state is not None
    rng = random.Random(chunk)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 17, 40, 9)]
    ref, got = requests(f"p{chunk}", prompts), requests(f"e{chunk}", prompts)
    drive = dict(chunk=chunk, block_size=plain.block_size, state_slots=True)
    run_requests(partial(execute_step, plain), ref, num_blocks=plain.num_blocks,
                 first_step_id=plain.batch.last_step_id + 1, **drive)
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, eagle), got, num_blocks=eagle.num_blocks,
                 first_step_id=eagle.batch.last_step_id + 1, num_draft_slots=K, spec_results=results, **drive)
    assert [r.output for r in ref] == [r.output for r in got]
    drafts = sum(sum(r.spec_num_draft_tokens) for r in results)
    assert drafts > len(prompts) * 5, "every decode step after the first should verify the head's drafts"
    assert sum(sum(r.spec_num_accepted_tokens) for r in results) < drafts, "rejections roll back"
