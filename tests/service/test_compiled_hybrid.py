"""The compiled forward (-O1) on hybrid models (Qwen3.5: Gated DeltaNet beside attention; Nemotron-H: Mamba2 beside
attention; slow: Qwen3-Next and Granite 4.0 hybrid with their MoE), on random-weight checkpoints transformers wrote
here, against the eager forward and transformers float32:

- the model: two sequences prefilled in chunks while the other decodes, every step padded to the compiled size (the
  first step, above it, runs eager); every row's logits equal the eager forward's and transformers', greedy tokens
  equal; the padding rows write no state slot and no KV block (the pool's other slots and blocks stay NaN);
- the runner with MTP drafts (Qwen3.5's own random MTP layer) or a random EAGLE-3 head's: greedy tokens equal plain
  eager decoding, while most drafts are rejected and rolled back out of the recurrent state through the compiled
  forward.

One compiled size keeps the compile short; the model and the runner of a family trace the same graph, so the second
loads it from the module's inductor cache.
"""

from __future__ import annotations

import json
import random
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

import kernels
from protos import worker_pb2 as pb
from tests.service.test_hybrid_families import BLOCK, make_checkpoint, prompts
from tests.support.driver import DriverRequest, run_requests
from worker_svc.config import CompilationConfig, WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.compiled_hybrid import CompiledHybridForward
from worker_svc.model.loader import load_hf_dir
from worker_svc.server import execute_step

pytestmark = pytest.mark.heavy  # every test here compiles cold: the default run, not --fast

SIZE = 16
SIZES = json.dumps({"cudagraph_capture_sizes": [SIZE]})
CHUNKS = (12, 7, 7, 7, 7, 7, 7, 7)  # tokens per sequence and step: 2 x 12 runs eager, 2 x 7 and below padded to 16
DECODES = 8


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # a fresh cache, and no leftover setting for later tests
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def build(path: str, **kwargs):
    config, weights = load_hf_dir(path)
    return models.by_name(config.architecture)(config, weights, torch.float32, "cpu", **kwargs)


class PoolRun:
    """Sequences over a NaN-filled KV pool and state pool: only what the steps write is ever a number."""

    def __init__(self, model, tables: list[list[int]], slots: list[int]):
        self.model, self.tables, self.slots = model, tables, slots
        self.kv = torch.full(model.kv_cache_shape(16, BLOCK), float("nan"))
        self.cache = StateCache(model.state_shape(), 5, torch.float32, torch.float32, torch.device("cpu"))
        self.cache.conv.fill_(float("nan"))
        self.cache.ssm.fill_(float("nan"))
        self.cache.zero(torch.tensor(slots))
        self.lengths = [0] * len(slots)

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Every row's logits, per sequence of `chunks`."""
        on = list(chunks)
        lens = [len(chunks[i]) for i in on]
        ends = [self.lengths[i] + n for i, n in zip(on, lens, strict=True)]
        meta = kernels.build_attention_metadata(lens, ends, [self.tables[i] for i in on], BLOCK, "cpu")
        positions = torch.cat([torch.arange(e - n, e) for e, n in zip(ends, lens, strict=True)])
        state = StateStep(self.cache, torch.tensor([self.slots[i] for i in on]), meta.cu_seqlens_q.long())
        ids = torch.tensor(sum((chunks[i] for i in on), []))
        logits = self.model.forward(ids, positions, self.kv, meta, torch.arange(len(ids)), state=state)
        for i, e in zip(on, ends, strict=True):
            self.lengths[i] = e
        return list(logits.split(lens))


# The MoE hybrids (their experts' loop an island) compile longer: slow.
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", pytest.param("qwen3_next", marks=pytest.mark.slow),
                                    pytest.param("granitemoehybrid", marks=pytest.mark.slow)])
def test_compiled_equals_eager_and_transformers_and_padding_writes_nothing(family, tmp_path, inductor_cache):
    hf = make_checkpoint(family, tmp_path)
    compiled = CompiledHybridForward(build(str(tmp_path), prepack=False), CompilationConfig((SIZE,)))
    compiled.warm_up()
    tables, slots = [[5, 2, 9, 0, 12], [7, 11, 3, 14, 1]], [3, 1]
    runs = [PoolRun(build(str(tmp_path)), tables, slots), PoolRun(compiled, tables, slots)]
    plens = [len(p) for p in prompts()]  # 45 and 30 tokens; then each decodes greedily
    seqs = [list(p) for p in prompts()]
    done = [0, 0]
    rows: list[list[torch.Tensor]] = [[], []]
    padded = []
    for step in range(len(CHUNKS) + DECODES):
        size = CHUNKS[min(step, len(CHUNKS) - 1)]
        chunks = {i: seq[done[i]:done[i] + size] for i, seq in enumerate(seqs)
                  if done[i] < len(seq) and len(seq) - plens[i] < DECODES}
        if not chunks:
            break
        padded.append(compiled.padded_size(sum(map(len, chunks.values()))))
        want, got = (r.step(chunks) for r in runs)
        for i, w, g in zip(chunks, want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-4 * max(1.0, w.abs().max().item()))  # as HF's
            assert g.argmax(-1).tolist() == w.argmax(-1).tolist(), f"{family}: step {step} sequence {i}"
            rows[i].append(g)
            done[i] += len(chunks[i])
            if done[i] == len(seqs[i]):  # the next token: the last row's greedy choice
                seqs[i].append(int(g[-1].argmax()))
    assert padded[0] is None and set(padded[1:]) == {SIZE}, padded  # the first step eager, then every one padded
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            expected = hf(torch.tensor([seq[:-1]])).logits[0].float()
        diff = (torch.cat(rows[i]) - expected).abs().max().item()
        assert diff < 2e-4 * max(1.0, expected.abs().max().item()), f"{family}: max logit diff {diff}"
    pool = runs[1]
    unused_slots = [s for s in range(pool.cache.num_slots) if s not in slots]
    assert pool.cache.conv[:, unused_slots].isnan().all() and pool.cache.ssm[:, unused_slots].isnan().all()
    assert not pool.cache.ssm[:, slots].isnan().any()
    used_blocks = sorted({b for t in tables for b in t})
    unused_blocks = [b for b in range(pool.kv.shape[2]) if b not in used_blocks]
    assert pool.kv[:, :, unused_blocks].isnan().all(), "a padding row wrote the KV cache"
    for i, table in enumerate(tables):  # past each sequence's last token its last block is still unwritten
        last = pool.lengths[i] % BLOCK
        assert pool.kv[:, :, table[pool.lengths[i] // BLOCK], last:].isnan().all()


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_greedy_with_head_drafts_on_the_compiled_forward_equals_plain_decoding(method, tmp_path, inductor_cache):
    """MTP reads the final normed states the eager head computes from the real rows; EAGLE-3 the layer inputs the
    capture islands hand it from inside the graph."""
    from tests.service.test_eagle3_on_hybrids import AUX, DIMS
    from tests.support.spec_heads import add_mtp_layer, write_eagle3_head

    target = str(tmp_path / "target")
    make_checkpoint("qwen3_5", target)
    if method == "mtp":
        add_mtp_layer(target)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        head = write_eagle3_head(str(tmp_path / "head"), aux_layers=AUX["qwen3_5"], dims=DIMS, draft_vocab=160)
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    opts = dict(model=target, dtype="float32", num_gpu_blocks_override=128, num_state_slots=8)
    plain = ModelRunner(WorkerConfig(**opts))
    compiled = ModelRunner(WorkerConfig(**opts, speculative_config=json.dumps(spec), optimization_level=1,
                                        compilation_config=SIZES))
    assert isinstance(compiled.model, CompiledHybridForward) and compiled.heads is not None
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(7)
    ids = [[rng.randrange(300) for _ in range(n)] for n in (5, 17, 40, 9)]
    params = pb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref, got = ([DriverRequest(f"{tag}-{i}", p, params, arrival_step=i % 3) for i, p in enumerate(ids)]
                for tag in ("plain", method))
    run_requests(partial(execute_step, plain), ref, chunk=7, num_blocks=plain.num_blocks,
                 block_size=plain.block_size, first_step_id=plain.batch.last_step_id + 1, state_slots=True)
    results: list[pb.StepResult] = []
    run_requests(partial(execute_step, compiled), got, chunk=7, num_blocks=compiled.num_blocks,
                 block_size=compiled.block_size, first_step_id=compiled.batch.last_step_id + 1, num_draft_slots=2,
                 spec_results=results, state_slots=True)
    assert [r.output for r in ref] == [r.output for r in got]
    # Small steps ran on one thread fewer at times (the runner's choice): no graph was compiled for them.
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph while serving"
    drafts = sum(sum(r.spec_num_draft_tokens) for r in results)
    assert drafts > 0 and sum(sum(r.spec_num_accepted_tokens) for r in results) < drafts, "rejections roll back"
