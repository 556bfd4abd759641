"""Mixtral and Qwen3-MoE from transformers-written random checkpoints: the loader's name mapping and expert
stacking, logits equal to transformers' over chunked prefill and decode on a paged pool, tensor parallel 2 equal
to one rank (two gloo processes), and the config.json fields that are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from llmserve.processes import free_port
from tests.service.test_model import PagedRunner
from tests.support import moe_checkpoints as mc
from worker_svc.model import families as models
from worker_svc.model.loader import load_hf_dir
from worker_svc.parallel.sharding import FULL, Shard, local_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for family in mc.FAMILIES:
        path = str(tmp_path_factory.mktemp(family))
        out[family] = (path, mc.write_checkpoint(family, path))
    return out


def build(path: str, shard: Shard = FULL, tp=None, prepack: bool | None = None):
    config, weights = load_hf_dir(path, shard)
    return models.by_name(config.architecture)(local_config(config, shard.size), weights, torch.float32, "cpu",
                                                tp=tp, prepack=prepack)


def chunked_logits(model, prompts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Every prompt row's logits, the prompts prefilled together in chunks of `chunk` tokens per sequence (later
    chunks attend to the earlier ones through the paged pool)."""
    runner = PagedRunner(model, num_blocks=64)
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    for start in range(0, max(map(len, prompts)), chunk):
        chunks = {i: p[start:start + chunk] for i, p in enumerate(prompts) if len(p) > start}
        logits = runner.step(chunks, all_logits=True)
        if logits is None:  # a tensor-parallel rank other than 0
            continue
        offset = 0
        for i, tokens in chunks.items():
            rows[i].append(logits[offset:offset + len(tokens)])
            offset += len(tokens)
    return [torch.cat(rows[i]) for i in range(len(prompts)) if rows[i]]


@pytest.mark.parametrize("family", mc.FAMILIES)
def test_config_and_stacked_experts(checkpoints, family):
    path, hf = checkpoints[family]
    model = build(path, prepack=False)
    c = model.config
    assert c.architecture == family and c.num_experts == 4 and c.num_experts_per_tok == 2
    sparse = [layer for layer in model.layers if layer.moe is not None]
    if family == "mixtral":
        assert c.moe_layers is None and c.moe_intermediate_size == 96 and len(sparse) == 2
        hf_experts = hf.model.layers[0].mlp.experts
    else:  # layer 1 is in mlp_only_layers: a dense MLP of intermediate_size
        assert c.moe_layers == [0, 2] and c.moe_intermediate_size == 48 and len(sparse) == 2
        assert model.layers[1].moe is None and model.layers[1].gate.shape == (80, 64)
        hf_experts = hf.model.layers[0].mlp.experts
    moe0 = model.layers[0].moe
    assert torch.equal(moe0.gate_up, hf_experts.gate_up_proj.detach())  # transformers stacks the same way
    assert torch.equal(moe0.down, hf_experts.down_proj.detach())
    assert moe0.norm_topk_prob and moe0.float32_weights == (family == "mixtral")


@pytest.mark.parametrize("prepack", [False, True], ids=["dense", "prepacked"])
@pytest.mark.parametrize("family", mc.FAMILIES)
def test_chunked_prefill_and_decode_match_transformers(checkpoints, family, prepack):
    path, hf = checkpoints[family]
    model = build(path, prepack=prepack)
    assert isinstance(model.layers[0].moe.gate_up, list) == model.prepacked  # prepacked where oneDNN is there
    prompts = mc.prompts(3, seed=7)
    for ids, got in zip(prompts, chunked_logits(model, prompts, chunk=16), strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Greedy decode through the pool equals transformers' generate.
    runner = PagedRunner(model, num_blocks=64, seed=3)
    ids = prompts[1]
    tokens = [int(runner.step({0: ids})[0].argmax())]
    for _ in range(11):
        tokens.append(int(runner.step({0: tokens[-1:]})[0].argmax()))
    want, margins = mc.hf_greedy(hf, ids, 12)
    assert tokens == want, margins


def test_compiled_forward_is_refused(checkpoints):
    from worker_svc.config import CompilationConfig
    from worker_svc.model.compiled import CompiledForward

    config, weights = load_hf_dir(checkpoints["mixtral"][0])
    model = models.by_name("mixtral")(config, weights, torch.float32, "cpu", prepack=False)
    with pytest.raises(ValueError, match="the compiled forward runs the Llama-shaped decoder only, not mixtral"):
        CompiledForward(model, CompilationConfig())


def _rank_main(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    from worker_svc.parallel.rank_group import RankGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = RankGroup(rank, 2, rank, torch.device("cpu"))
    prompts = mc.prompts(2, seed=11)
    for i, path in enumerate(paths):
        model = build(path, Shard(rank, 2), tp=group, prepack=False)
        assert model.layers[0].moe.gate_up.shape[1] == 2 * model.config.moe_intermediate_size
        logits = chunked_logits(model, prompts, chunk=8)
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, f"{i}.pt"))
    dist.destroy_process_group()


def test_tensor_parallel_2_matches_one_rank(checkpoints, tmp_path):
    paths = [checkpoints[f][0] for f in mc.FAMILIES]
    prompts = mc.prompts(2, seed=11)
    expected = [chunked_logits(build(p), prompts, chunk=8) for p in paths]
    mp.spawn(_rank_main, args=(free_port(), paths, str(tmp_path)), nprocs=2, join=True)
    for i, want in enumerate(expected):
        got = torch.load(tmp_path / f"{i}.pt")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _edit_config(src: str, dst, **changes) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("family,changes,message", [
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok must be an int in \[1, 4\]"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an int >= 1"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     "rope_parameters.rope_type='yarn' is not supported"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, family, changes, message):
    path = _edit_config(checkpoints[family][0], tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_dir(path)


def test_tensor_parallel_size_must_divide_the_experts(checkpoints, tmp_path):
    path = _edit_config(checkpoints["qwen3_moe"][0], tmp_path / "edited", moe_intermediate_size=50)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide the experts' intermediate size 50"):
        load_hf_dir(path, Shard(0, 4))
