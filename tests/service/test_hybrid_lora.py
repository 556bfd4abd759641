"""LoRA on the hybrid families (Qwen3-Next with its MoE, Qwen3.5, Nemotron-H, Granite 4.0 hybrid with its MoE):
random adapters in the PEFT layout on the attention and MLP projections of a transformers-written random checkpoint.

- the model over the paged KV and the state pool with a LoraPool, two adapters and the base model side by side in
  chunked prefill: each row's logits equal transformers' float32 with that adapter merged into its weights (Qwen's
  q_proj adapter, twice as wide for the output gate, included), and the base rows equal the plain model's;
- adapters naming a recurrent layer's module (Gated DeltaNet's in_proj_qkvz / in_proj_qkv / out_proj, Mamba2's
  in_proj / out_proj, conv1d) or a sparse MoE block's are refused at load, naming the module; at start through
  --lora-modules the same, as a ConfigError.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from common.config import ConfigError
from tests.service.test_hybrid_families import BLOCK, FAMILIES, make_checkpoint
from tests.support.lora_adapters import linear_modules, merged, write_modules
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.model.lora import LoraError, LoraPool, load_peft_adapter

# Per family: the modules an adapter may target (PEFT's target_modules), paths PEFT would also pick that are not
# served (Qwen3-Next's shared expert), and recurrent modules an adapter may not name.
SERVED = {
    "qwen3_next": (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("shared_expert",),
                   ("in_proj_qkvz", "in_proj_ba", "out_proj", "conv1d")),
    "qwen3_5": (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), (),
                ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d")),
    "nemotron_h": (("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"), (),
                   ("in_proj", "out_proj", "conv1d")),
    "granitemoehybrid": (("q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"), (),
                         ("in_proj", "out_proj", "conv1d")),
}
ROWS = np.array([0, 1, 2])  # batch rows: adapter "all", adapter "attn", the base model
LENGTHS = (21, 30, 14)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"{name}-lora")
    hf = make_checkpoint(name, path)
    modules, skip, _ = SERVED[name]
    write_modules(str(path / "all"), linear_modules(hf, modules, skip), modules, rank=4, alpha=8, seed=1, std_b=0.3)
    attn = modules[:4]
    write_modules(str(path / "attn"), linear_modules(hf, attn), attn, rank=2, alpha=4, seed=2, std_b=0.3)
    return name, hf, path


def adapters(path) -> dict[str, str]:
    return {"all": str(path / "all"), "attn": str(path / "attn")}


def sequences(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def chunked_logits(model, pool: LoraPool | None, ids: list[list[int]], chunk: int) -> list[torch.Tensor | None]:
    """Each sequence's logits rows, the sequences side by side in chunks of `chunk` (batch rows ROWS, state slots
    2, 0, 1); `pool` (when given) groups each step's tokens by adapter first."""
    cache = StateCache(model.state_shape(), 3, torch.float32, torch.float32, torch.device("cpu"))
    slots = [2, 0, 1]
    cache.zero(torch.tensor(slots))
    kv = torch.zeros(model.kv_cache_shape(16, BLOCK))
    tables = [[0, 1], [2, 3], [4, 5]]
    got: list[list] = [[] for _ in ids]
    for start in range(0, max(map(len, ids)), chunk):
        on = [i for i, p in enumerate(ids) if p[start:start + chunk]]
        lens = [len(ids[i][start:start + chunk]) for i in on]
        if pool is not None:
            pool.begin_step(ROWS[on], np.array(lens))
        meta = kernels.build_attention_metadata(lens, [start + n for n in lens], [tables[i] for i in on], BLOCK,
                                                "cpu")
        positions = torch.cat([torch.arange(start, start + n) for n in lens])
        step = StateStep(cache, torch.tensor([slots[i] for i in on]), meta.cu_seqlens_q.long())
        tokens = torch.tensor(sum((ids[i][start:start + chunk] for i in on), []))
        logits = model.forward(tokens, positions, kv, meta, torch.arange(len(tokens)), state=step)
        for i, rows in zip(on, logits.split(lens) if logits is not None else [None] * len(on), strict=True):
            got[i].append(rows)
    return [None if g[0] is None else torch.cat(g) for g in got]  # None: a tensor-parallel rank other than 0


def with_pool(model, config, paths: dict[str, str], shard=None) -> LoraPool:
    kw = {} if shard is None else {"shard": shard}
    model.lora = pool = LoraPool(config, max_loras=2, max_rank=4, max_cpu_loras=2, dtype=torch.float32,
                                 device=torch.device("cpu"), **kw)
    slots = [pool.activate(name, p, set()) for name, p in paths.items()]
    pool.set_rows(ROWS, np.array([*slots, -1]))
    return pool


@pytest.mark.parametrize("chunk", [7, 32])
def test_adapter_rows_equal_transformers_with_the_adapter_merged(family, chunk):
    name, hf, path = family
    config, weights = load_hf_dir(str(path))
    model = models.by_name(config.architecture)(config, weights, torch.float32, "cpu")
    pool = with_pool(model, config, adapters(path))
    ids = sequences(config.vocab_size)
    got = chunked_logits(model, pool, ids, chunk)
    oracles = [merged(hf, p) for p in adapters(path).values()] + [hf]
    for i, (oracle, seq) in enumerate(zip(oracles, ids, strict=True)):
        with torch.no_grad():
            want = oracle(torch.tensor([seq])).logits[0].float()
            plain = hf(torch.tensor([seq])).logits[0].float()
        diff = (got[i] - want).abs().max().item()
        assert diff < 2e-4 * max(1.0, want.abs().max().item()), f"{name} row {i} chunk {chunk}: logit diff {diff}"
        if i < 2:  # the adapters change what they touch
            assert (want - plain).abs().max().item() > 1e-2, f"{name}: adapter {i} changes nothing"


def test_recurrent_and_moe_modules_are_refused_at_load(family, tmp_path):
    name, hf, path = family
    config, _ = load_hf_dir(str(path))
    _, _, recurrent = SERVED[name]
    for module in recurrent:
        bad = write_modules(str(tmp_path / module), linear_modules(hf, (module,)) or {"model.layers.0.x": (4, 4)},
                            ("q_proj", module), rank=2, alpha=2)
        with pytest.raises(LoraError, match=rf"adapter_config.json: target module '{module}' is a projection of the "
                                            r"(Gated DeltaNet|Mamba2) layers \(recurrent\)"):
            load_peft_adapter("bad", bad, config, 8)
    # A tensor of a recurrent module under a served name in target_modules: refused naming layer and module.
    mixer = next(n for n in linear_modules(hf, recurrent))
    bad = write_modules(str(tmp_path / "tensor"), {mixer: (4, 4)}, ("q_proj",), rank=2, alpha=2)
    module = mixer.rsplit(".", 1)[1]
    with pytest.raises(LoraError, match=rf"adapter_model.safetensors: tensor .*: layer \d+ .*{module} is a "
                                        r"projection of the (Gated DeltaNet|Mamba2) layers"):
        load_peft_adapter("bad", bad, config, 8)
    if name == "qwen3_next":  # PEFT's gate_proj also picks the shared expert's: a sparse MoE block's
        shared = linear_modules(hf, ("gate_proj",))
        bad = write_modules(str(tmp_path / "moe"), shared, ("gate_proj",), rank=2, alpha=2)
        with pytest.raises(LoraError, match=r"layer 0 mlp\.shared_expert\.gate_proj is part of the sparse MoE"):
            load_peft_adapter("bad", bad, config, 8)
    # At start, --lora-modules: a ConfigError with the same words.
    with pytest.raises(ConfigError, match=rf"target module '{recurrent[0]}' is a projection of the"):
        ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=16,
                                 num_state_slots=4, enable_lora=True, max_lora_rank=8,
                                 lora_modules=[f"bad={tmp_path / recurrent[0]}"]))
