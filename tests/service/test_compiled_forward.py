"""The compiled forward (-O1..3) against the eager one on a tiny random-weight Llama: same greedy tokens, logits
and KV cache at padded sizes and in mixed prefill+decode steps, no compile while serving, eager above the largest
size; and the flags' validation."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

from common.config import for_device, parse
from common.validation import ConfigError
from protos import worker_pb2 as pb
from tests.service.test_model import PagedRunner
from tests.support.driver import DriverRequest, run_requests
from tests.support.random_weights import randomize
from worker_svc.config import CompilationConfig, WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.compiled import CompiledForward, wants_compiled
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import load_model_weights
from worker_svc.server import execute_step

SIZES = (4, 8)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_weights(tiny_path):
    return load_model_weights(tiny_path)


@pytest.fixture(scope="module")
def compiled(tiny_weights, tmp_path_factory):
    config, weights = tiny_weights
    cache = str(tmp_path_factory.mktemp("inductor"))
    with pytest.MonkeyPatch.context() as mp:  # a fresh cache, and no leftover setting for later tests
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", cache)
        fwd = CompiledForward(LlamaModel(config, weights, torch.float32, "cpu", prepack=False),
                              CompilationConfig(cudagraph_capture_sizes=SIZES))
        fwd.warm_up()
        yield fwd


@pytest.mark.heavy  # a cold inductor compile: the default run, not --fast
def test_compiled_matches_eager_without_compiling_while_serving(tiny_weights, compiled):
    config, weights = tiny_weights
    eager = PagedRunner(LlamaModel(config, weights, torch.float32, "cpu"), num_blocks=32, seed=3)  # the default
    ours = PagedRunner(compiled, num_blocks=32, seed=3)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "warm-up compiled nothing"
    steps = [
        {0: [5, 6, 7]},  # prefill of 3: padded to 4
        {0: None, 1: [9, 8, 7, 6, 5]},  # mixed: 1 decode + a prefill of 5 -> 6, padded to 8
        {0: None, 1: None},  # decode of 2 -> 4
        {0: None, 1: None, 2: [1, 2, 3, 4, 5, 6, 7, 8]},  # 10 rows: above the largest size, eager
        {0: None, 1: None, 2: None},  # 3 -> 4
        {2: None, 3: list(range(20, 27))},  # 8: an exact size
    ]
    last: dict[int, int] = {}
    padded = set()
    for step in steps:
        chunks = {sid: tokens if tokens is not None else [last[sid]] for sid, tokens in step.items()}
        padded.add(compiled.padded_size(sum(map(len, chunks.values()))))
        want, got = eager.step(chunks), ours.step(chunks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        last.update(zip(chunks, want.argmax(-1).tolist(), strict=True))
    assert padded == {4, 8, None}
    # Padding rows never reach the KV cache: the same slots written (untouched ones stay NaN), the same values.
    torch.testing.assert_close(ours.kv, eager.kv, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph while serving"


@pytest.fixture
def two_threads():
    """Two intra-op threads, so the runner's small-step chooser has one fewer to try (cpu/threads.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.heavy  # a cold inductor compile: the default run, not --fast
def test_worker_runner_with_o1_matches_eager(tiny_path, compiled, monkeypatch, two_threads):
    """The worker's own path: `-O1` makes the runner build dense weights and compile at start-up; greedy tokens
    equal the default (eager) runner's in mixed steps (chunks of 3 tokens, requests arriving over time). Small
    steps ran on 2 threads and on 1 (the runner's chooser tries both in turns), and no graph was compiled while
    serving: dynamo guards on the thread count, so the warm-up built the small sizes for both."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled.cache_dir)
    outputs = []
    for argv in ([], ["-O1", "--compilation-config", '{"cudagraph_capture_sizes": [4, 8]}']):
        torch.set_num_threads(2)  # the last run's last step may have left one
        runner = ModelRunner(parse(WorkerConfig, ["--model", tiny_path, "--dtype", "float32",
                                                  "--num-gpu-blocks-override", "64", *argv]))
        assert isinstance(runner.model, CompiledForward) == bool(argv)
        graphs = counters["stats"]["unique_graphs"]
        reqs = [DriverRequest(f"r{i}", list(range(10 + i, 15 + 2 * i)), pb.SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True), arrival_step=i) for i in range(3)]
        run_requests(partial(execute_step, runner), reqs, chunk=3, num_blocks=runner.num_blocks,
                     block_size=runner.block_size)
        outputs.append([r.output for r in reqs])
        assert {threads for _, threads in runner.small_step_threads.recent_s} == {1, 2}
        assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph while serving"
    assert outputs[0] == outputs[1]
    assert all(len(o) == 6 for o in outputs[0])


def test_a_thread_count_without_graphs_runs_on_the_warm_up_count(compiled):
    """A step on a count the warm-up built nothing for runs pinned to the warm-up's count: no compile."""
    runner = PagedRunner(compiled, num_blocks=32, seed=3)
    graphs, threads = counters["stats"]["unique_graphs"], torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        runner.step({0: [5, 6, 7]})
        assert torch.get_num_threads() == threads + 1  # the caller's count is back
    finally:
        torch.set_num_threads(threads)
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph while serving"


def test_padded_sizes():
    cfg = CompilationConfig()
    assert cfg.sizes() == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert CompilationConfig(max_cudagraph_capture_size=16).sizes() == (1, 2, 4, 8, 16)
    assert CompilationConfig.parse('{"cudagraph_capture_sizes": [8, 2, 2]}').sizes() == (2, 8)


@pytest.mark.parametrize("argv, flag", [
    (["-O", "4"], "--optimization-level"),
    (["--optimization-level", "-1"], "--optimization-level"),
    (["--compilation-config", '{"cudagraph_capture_sizes": [4], "level": 3}'], "--compilation-config"),
    (["--compilation-config", '{"cudagraph_capture_sizes": [0]}'], "--compilation-config"),
    (["--compilation-config", "not json"], "--compilation-config"),
])
def test_bad_values_refused_naming_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(WorkerConfig, argv)


def test_which_forward_the_flags_pick():
    assert not wants_compiled(for_device(parse(WorkerConfig, []), "cpu"))  # eager by default
    assert wants_compiled(parse(WorkerConfig, ["-O3"]))
    assert not wants_compiled(parse(WorkerConfig, ["-O3", "--enforce-eager"]))
    with pytest.raises(ConfigError, match="--quantization"):
        wants_compiled(parse(WorkerConfig, ["-O1", "--quantization", "gguf"]))
    assert wants_compiled(parse(WorkerConfig, ["-O1", "-tp", "2"]))  # tests/e2e/test_tensor_parallel.py


@pytest.mark.heavy  # a cold inductor compile: the default run, not --fast
def test_compiled_bfloat16_matches_eager_up_to_rounding(tiny_weights, tmp_path, monkeypatch):
    """bfloat16: the compiled graphs round where inductor fuses, the eager forward where each op ends, so logits
    agree to bfloat16's precision and greedy tokens wherever the top two logits are further apart than that."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config, weights = tiny_weights
    eager = PagedRunner(LlamaModel(config, weights, torch.bfloat16, "cpu"), num_blocks=32, seed=3)
    fwd = CompiledForward(LlamaModel(config, weights, torch.bfloat16, "cpu", prepack=False),
                          CompilationConfig(cudagraph_capture_sizes=SIZES))
    fwd.warm_up()
    ours = PagedRunner(fwd, num_blocks=32, seed=3)
    chunks = {0: [5, 6, 7], 1: [9, 8, 7, 6, 5]}  # 8 rows (a compiled size), then decodes of 2 padded to 4
    for _ in range(6):
        want, got = eager.step(chunks), ours.step(chunks)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)  # measured: up to 0.04 at |logits| ~3
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1  # not a near-tie at bfloat16's precision
        assert clear.any()
        assert got.argmax(-1)[clear].tolist() == want.argmax(-1)[clear].tolist()
        chunks = {sid: [int(t)] for sid, t in zip(chunks, want.argmax(-1).tolist(), strict=True)}
