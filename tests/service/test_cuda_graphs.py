"""-O2 on a CUDA device: the compiled forward replays CUDA graphs for decode-only steps (worker_svc/model/compiled.py,
torch's cudagraph trees, weights marked static). Through the worker's own path (ModelRunner; chunked prefill beside
decodes, requests arriving over time, so steps alternate between mixed ones and graph replays) the greedy tokens equal
the eager runner's. Needs a CUDA device: experiments/gpu_check.sh runs it on the first machine that has one."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from common.config import parse
from protos import worker_pb2 as pb
from tests.service.test_compiled_forward import tiny_path  # noqa: F401  (the module's random Llama)
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.compiled import CompiledForward
from worker_svc.server import execute_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_cuda_graph_replays_give_the_eager_tokens(tiny_path, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    outputs = []
    for argv in ([], ["-O2", "--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}']):
        runner = ModelRunner(parse(WorkerConfig, ["--model", tiny_path, "--device", "cuda", "--dtype", "float32",
                                                  "--num-gpu-blocks-override", "64", *argv]))
        assert isinstance(runner.model, CompiledForward) == bool(argv)
        assert (getattr(runner.model, "_graphs", None) is not None) == bool(argv)
        reqs = [DriverRequest(f"r{i}", list(range(10 + i, 15 + 2 * i)), pb.SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True), arrival_step=2 * i) for i in range(4)]
        run_requests(partial(execute_step, runner), reqs, chunk=3, num_blocks=runner.num_blocks,
                     block_size=runner.block_size)
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1]
    assert all(len(o) == 12 for o in outputs[0])
