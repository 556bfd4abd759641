"""Hybrid families against transformers (Gated DeltaNet + attention: Qwen3-Next with its MoE, Qwen3.5 text;
Mamba2 + attention: Nemotron-H with its MLP blocks, Granite 4.0 hybrid with its MoE and multipliers): a random-weight
checkpoint written by transformers here, loaded through the registry.

- the model over the paged KV and the state pool: logits of every row equal transformers' float32 under chunked
  prefill with chunks of 1, 7 and 32 tokens, two sequences of different lengths side by side;
- the runner through plans (worker_svc/plan.py, as the scheduler sends them): greedy tokens equal transformers',
  a fork restored from a state snapshot continues exactly as its parent, and plans that break the state contract
  are refused, naming the request and the field;
- config.json options the model would ignore, and settings it does not compose with yet, are refused at start
  (LoRA on hybrids: test_hybrid_lora.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import kernels
from common.config import ConfigError
from common.sampling_fields import SamplingParams
from tests.support.random_weights import randomize
from worker_svc.config import WorkerConfig
from worker_svc.core.errors import InvalidPlan
from worker_svc.core.plan import CachedRequests, JoiningRequest, StepPlan
from worker_svc.core.runner import ModelRunner
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir

BLOCK = 16
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)
DELTANET = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
# name -> (config class, model class, config fields, the layer types we read)
FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, mlp_only_layers=[1]), DELTANET["layer_types"]),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, DELTANET, DELTANET["layer_types"]),
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                   dict(layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
                        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=16),
                   ["mamba", "full_attention", "mlp", "mamba"]),
    "granitemoehybrid": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                         dict(intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
                              layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
                              mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4,
                              num_experts_per_tok=2, embedding_multiplier=2.0, attention_multiplier=0.3,
                              residual_multiplier=0.5, logits_scaling=4.0, position_embedding_type="rope"),
                         ["mamba", "full_attention", "mamba"]),
}


def make_checkpoint(family: str, path) -> torch.nn.Module:
    config_cls, model_cls, fields, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **fields}))
    randomize(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large embeddings and head: clear greedy margins
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
    model.eval().save_pretrained(path, safe_serialization=True)
    return model


def prompts(lengths=(45, 30)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, make_checkpoint(request.param, path), path


def test_registry_reads_the_hybrid_config(family):
    name, hf, path = family
    config, _ = load_hf_dir(str(path))
    assert models.MODELS[hf.config.architectures[0]].name == config.architecture == name
    assert config.layer_types == FAMILIES[name][3]
    if name.startswith("qwen"):
        assert config.partial_rotary_factor == 0.25
        assert config.moe_layers == ([0, 2] if name == "qwen3_next" else [])


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_prefill_logits_match_hf(family, chunk):
    """Two prompts side by side in chunks of `chunk` tokens, each from the state its slot carries."""
    name, hf, path = family
    config, weights = load_hf_dir(str(path))
    model = models.by_name(config.architecture)(config, weights, torch.float32, "cpu")
    ids = prompts()
    cache = StateCache(model.state_shape(), 5, torch.float32, torch.float32, torch.device("cpu"))
    cache.conv.fill_(float("nan"))  # only the slots in use are zeroed: nothing else may be read
    cache.ssm.fill_(float("nan"))
    slots = [3, 1]
    cache.zero(torch.tensor(slots))
    kv = torch.full(model.kv_cache_shape(16, BLOCK), float("nan"))
    tables = [[5, 2, 9, 0], [7, 11, 3, 14]]
    got = {i: [] for i in range(len(ids))}
    for start in range(0, max(map(len, ids)), chunk):
        on = [i for i, p in enumerate(ids) if p[start:start + chunk]]
        parts = [ids[i][start:start + chunk] for i in on]
        lens = [len(p) for p in parts]
        meta = kernels.build_attention_metadata(lens, [start + n for n in lens], [tables[i] for i in on], BLOCK,
                                                "cpu")
        positions = torch.cat([torch.arange(start, start + n) for n in lens])
        step = StateStep(cache, torch.tensor([slots[i] for i in on]), meta.cu_seqlens_q.long())
        logits = model.forward(torch.tensor(sum(parts, [])), positions, kv, meta, torch.arange(sum(lens)),
                               state=step)
        for i, rows in zip(on, logits.split(lens), strict=True):
            got[i].append(rows)
    for i, p in enumerate(ids):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0].float()
        diff = (torch.cat(got[i]) - expected).abs().max().item()
        assert diff < 2e-4 * max(1.0, expected.abs().max().item()), f"{name} chunk {chunk}: max logit diff {diff}"


# ------------------------------------------------------------------------------------------- the runner, by plans


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[],
                          logit_bias={}, bad_words=[])


class PlanDriver:
    """A minimal scheduler: requests in slots, blocks from a free list, one state slot each, chunks of `chunk`."""

    def __init__(self, runner: ModelRunner, chunk: int):
        self.runner, self.chunk = runner, chunk
        self.step_id = runner.batch.last_step_id
        self.free = list(range(runner.num_blocks))[::-1]
        self.reqs: dict[int, dict] = {}  # slot -> {tokens, prompt, computed, blocks, out, max, joined, state}

    def add(self, slot: int, prompt: list[int], max_tokens: int, state_slot: int, **join) -> None:
        self.reqs[slot] = dict(prompt=list(prompt), out=[], computed=join.get("computed", 0),
                               blocks=join.get("blocks", []), max=max_tokens, joined=False, state=state_slot,
                               copy=join.get("copy"))

    def _blocks(self, r: dict, upto: int) -> list[int]:
        new = []
        while (len(r["blocks"]) + len(new)) * BLOCK < upto:
            new.append(self.free.pop())
        return new

    def step(self, save: tuple[list[int], list[int]] = ([], []), limit: dict[int, int] | None = None) -> None:
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id)
        copy_src, copy_dst = [], []
        cached = {"slots": [], "sched": [], "counts": [], "ids": []}
        for slot, r in self.reqs.items():
            if len(r["out"]) >= r["max"]:
                continue
            known = len(r["prompt"]) + len(r["out"])
            n = min(self.chunk, known - r["computed"], (limit or {}).get(slot, 1 << 30))
            new = self._blocks(r, r["computed"] + n)
            if not r["joined"]:
                plan.new_requests.append(JoiningRequest(
                    slot, f"r{slot}", np.array(r["prompt"], dtype=np.int64), len(r["prompt"]), greedy(r["max"]),
                    r["blocks"] + new, r["computed"], n, state_slot=r["state"]))
                if r["copy"] is not None:
                    copy_src.append(r["copy"])
                    copy_dst.append(r["state"])
                r["joined"] = True
            else:
                cached["slots"].append(slot)
                cached["sched"].append(n)
                cached["counts"].append(len(new))
                cached["ids"] += new
            r["blocks"] = r["blocks"] + new
            r["computed"] += n
        plan.cached = CachedRequests(*(np.array(cached[k], dtype=np.int64) for k in ("slots", "sched", "counts",
                                                                                     "ids")))
        plan.state_copy_src, plan.state_copy_dst = np.array(copy_src, np.int64), np.array(copy_dst, np.int64)
        plan.state_save_src, plan.state_save_dst = (np.array(x, np.int64) for x in save)
        out = self.runner.execute(plan)
        for slot, token in zip(out.slots.tolist(), out.token_ids.tolist(), strict=True):
            self.reqs[slot]["out"].append(token)

    def run(self) -> None:
        while any(len(r["out"]) < r["max"] for r in self.reqs.values()):
            self.step()


@pytest.fixture(scope="module")
def runner(family):
    name, hf, path = family
    return name, hf, ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                                              num_gpu_blocks_override=64, num_state_slots=8))


def hf_greedy_check(name: str, hf, prompt: list[int], tokens: list[int]) -> None:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=0)
    expected = out.sequences[0, len(prompt):].tolist()
    for step, (mine, theirs, score) in enumerate(zip(tokens, expected, out.scores, strict=True)):
        if mine != theirs:  # allowed only where transformers' own choice was a near tie; the texts part there
            top2 = score[0].float().topk(2).values
            assert top2[0] - top2[1] < 1e-2, f"{name}: step {step} differs at a clear margin"
            assert step >= len(tokens) // 2, f"{name}: only {step} steps compared"
            return


def test_runner_reports_its_state_pool(runner):
    name, _, r = runner
    shape = r.model.state_shape()
    assert r.num_state_slots == 8
    assert r.state_bytes_per_slot == shape.num_layers * (shape.conv[0] * shape.conv[1] + int(np.prod(shape.ssm))) * 4
    assert shape.num_layers == 2
    assert r.kv.shape[0] == 1  # one attention layer of three holds KV


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_greedy_through_plans_matches_hf(runner, chunk):
    name, hf, r = runner
    driver = PlanDriver(r, chunk)
    ids = prompts()
    for i, p in enumerate(ids):
        driver.add(i, p, 8, state_slot=5 - i)
    driver.run()
    for i, p in enumerate(ids):
        hf_greedy_check(name, hf, p, driver.reqs[i]["out"])


def test_fork_from_a_state_snapshot_continues_like_its_parent(runner):
    """The parent prefills 32 of its 33 prompt tokens, the plan saves its state into a snapshot slot; a child joins
    with those 32 tokens computed (the parent's two full blocks, its state copied in) and decodes the same."""
    name, hf, r = runner
    prompt = prompts((33,))[0]
    driver = PlanDriver(r, 32)
    driver.add(0, prompt, 6, state_slot=2)
    driver.step(save=([2], [7]))  # the parent's state after its 32 tokens -> slot 7
    parent = driver.reqs[0]
    driver.add(1, prompt, 6, state_slot=4, computed=32, blocks=parent["blocks"][:2], copy=7)
    driver.run()
    assert driver.reqs[1]["out"] == parent["out"]
    hf_greedy_check(name, hf, prompt, parent["out"])


def _plan(step_id: int, **join) -> StepPlan:
    req = JoiningRequest(0, "bad", np.arange(5, dtype=np.int64), 5, greedy(2), [0], **join)
    return StepPlan(step_id=step_id, new_requests=[req])


@pytest.mark.parametrize("join, field", [
    (dict(num_scheduled_tokens=5), "state_slot -1 is not a state slot"),
    (dict(num_scheduled_tokens=5, state_slot=8), "state_slot 8 is not a state slot"),
    (dict(num_computed_tokens=3, num_scheduled_tokens=2, state_slot=1), "no state_copy fills its state_slot 1"),
])
def test_plans_breaking_the_state_contract_are_refused(runner, join, field):
    _, _, r = runner
    step = r.batch.last_step_id + 1
    with pytest.raises(InvalidPlan, match=field) as e:
        r.execute(_plan(step, **join))
    assert e.value.request_id == "bad"
    assert not len(r.batch.inputs) and r.batch.last_step_id == step - 1  # nothing applied


def test_copies_out_of_range_and_duplicate_owners_are_refused(runner):
    _, _, r = runner
    step = r.batch.last_step_id + 1
    plan = _plan(step, num_scheduled_tokens=5, state_slot=1)
    plan.state_save_src, plan.state_save_dst = np.array([1]), np.array([8])
    with pytest.raises(InvalidPlan, match=r"state_save\[0\]: src 1 and dst 8"):
        r.execute(plan)
    plan = _plan(step, num_scheduled_tokens=5, state_slot=1)
    other = JoiningRequest(1, "other", np.arange(5, dtype=np.int64), 5, greedy(2), [1], 0, 5, state_slot=1)
    plan.new_requests.append(other)
    with pytest.raises(InvalidPlan, match="state_slot 1 is already held"):
        r.execute(plan)


# ------------------------------------------------------------------------------------------------- refusals at start


@pytest.mark.parametrize("architecture, fields, named", [
    ("Qwen3NextForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("Qwen3_5ForCausalLM", {"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ("Qwen3_5ForCausalLM", {"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ("NemotronHForCausalLM", {"hybrid_override_pattern": "M*E"}, "MoE layers"),
    ("NemotronHForCausalLM", {"hybrid_override_pattern": "M*-", "mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
    ("GraniteMoeHybridForCausalLM", {"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
])
def test_config_options_the_model_would_ignore_are_refused(tmp_path, architecture, fields, named):
    config = {"architectures": [architecture], **COMMON, **DELTANET, "ssm_state_size": 8, "mamba_num_heads": 8,
              "mamba_head_dim": 8, "n_groups": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8,
              "mamba_n_groups": 2, "shared_intermediate_size": 48, "layer_types": ["mamba", "attention", "mamba"]
              if architecture.startswith("Granite") else DELTANET["layer_types"], **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        load_hf_dir(str(tmp_path))
    assert named in str(info.value) and "config.json" in str(info.value), str(info.value)


def test_auto_state_slots_follow_max_num_seqs_and_the_snapshot_share(family, caplog):
    """--num-state-slots auto: --max-num-seqs slots plus the snapshot share's room, reported and logged at start."""
    _, _, path = family
    opts = dict(model=str(path), dtype="float32", device="cpu", block_size=BLOCK, kv_cache_memory=64 << 20)
    with caplog.at_level("INFO", logger="worker_svc.core.runner"):
        r = ModelRunner(WorkerConfig(**opts, max_num_seqs=6, state_snapshot_share=0.25))
    assert r.num_state_slots == 8  # 6 / 0.75
    assert f"state pool: 8 slots (auto: --max-num-seqs 6, --state-snapshot-share 0.25) of {r.state_bytes_per_slot} " \
        f"bytes, {8 * r.state_bytes_per_slot} bytes in all" in caplog.text
    assert ModelRunner(WorkerConfig(**opts, max_num_seqs=6, state_snapshot_share=0)).num_state_slots == 6
    assert ModelRunner(WorkerConfig(**opts)).num_state_slots == 128  # the CPU default --max-num-seqs 64, share 0.5


def test_compiled_forward_with_adapters_is_refused_at_start(family):
    """-O1 and --enable-lora each serve a hybrid; together they are refused as for any family (inductor cannot
    trace the adapter hook's per-adapter grouping)."""
    _, _, path = family
    with pytest.raises(ConfigError, match="--enable-lora"):
        ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=8,
                                 optimization_level=1, enable_lora=True))


def test_state_dtype_and_budget_settings(family):
    """--mamba-ssm-cache-dtype bfloat16 halves the recurrent matrices (the conv windows stay in --dtype) and decodes
    as the float32 state does at these clear margins; a state pool that would eat the whole KV budget is refused."""
    name, hf, path = family
    opts = dict(model=str(path), dtype="float32", device="cpu", block_size=BLOCK, num_gpu_blocks_override=64,
                num_state_slots=4)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        r = ModelRunner(WorkerConfig(**opts, mamba_ssm_cache_dtype=dtype))
        driver = PlanDriver(r, 16)
        driver.add(0, prompts((20,))[0], 4, state_slot=3)
        driver.run()
        runs[dtype] = (r, driver.reqs[0]["out"])
    (full, tokens32), (half, tokens16) = runs["float32"], runs["bfloat16"]
    assert half.state.ssm.dtype == torch.bfloat16 and half.state.conv.dtype == torch.float32
    shape = full.model.state_shape()
    assert full.state_bytes_per_slot - half.state_bytes_per_slot == shape.num_layers * int(np.prod(shape.ssm)) * 2
    assert tokens16 == tokens32
    with pytest.raises(ConfigError, match="takes the whole KV memory budget"):
        ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 16,
                                 num_state_slots=64))
