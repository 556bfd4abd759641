"""worker_svc.model.layers.moe against transformers' sparse MoE blocks (Mixtral, Qwen3-MoE) on random weights: routing,
top-k renormalisation, the grouped expert matmuls and the tensor-parallel split of the experts."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from worker_svc.model.layers import moe

HIDDEN, INTER, EXPERTS = 32, 48, 6


def hf_block(family: str, top_k: int, norm_topk_prob: bool = True, seed: int = 0) -> torch.nn.Module:
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                            num_experts_per_tok=top_k)
        cls = MixtralSparseMoeBlock
    else:
        cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                             num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
        cls = Qwen3MoeSparseMoeBlock
    cfg._experts_implementation = "eager"  # transformers' reference loop over experts
    block = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return block


def our_weights(block: torch.nn.Module, family: str, norm_topk_prob: bool, dtype=torch.float32) -> moe.MoEWeights:
    return moe.MoEWeights(
        router=block.gate.weight.detach().to(dtype),
        gate_up=block.experts.gate_up_proj.detach().to(dtype),
        down=block.experts.down_proj.detach().to(dtype),
        top_k=block.gate.top_k,
        norm_topk_prob=True if family == "mixtral" else norm_topk_prob,
        float32_weights=family == "mixtral",
    )


CASES = [("mixtral", 2, True), ("mixtral", 1, True), ("qwen3_moe", 2, True), ("qwen3_moe", 2, False),
         ("qwen3_moe", 4, False), ("qwen3_moe", EXPERTS, True)]


@pytest.mark.parametrize("family,top_k,norm", CASES)
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_matches_transformers_float32(family, top_k, norm, tokens):
    block = hf_block(family, top_k, norm)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected = block(x)[0]
    got = moe.moe_forward(x[0], our_weights(block, family, norm))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_matches_transformers_bfloat16(family):
    block = hf_block(family, 2).to(torch.bfloat16)
    x = torch.randn(1, 19, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = block(x)[0]
    got = moe.moe_forward(x[0], our_weights(block, family, True, torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_route_renormalises_only_when_asked():
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(4))
    w_norm, ids = moe.route(x, router, 3, True)
    w_raw, ids_raw = moe.route(x, router, 3, False)
    assert torch.equal(ids, ids_raw)
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(9))
    probs = torch.softmax(x @ router.T, dim=-1)
    torch.testing.assert_close(w_raw, probs.gather(1, ids))
    assert (w_raw[:, :-1] >= w_raw[:, 1:]).all()  # best expert first


def test_sort_by_expert_groups_pairs():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [1, 0]])
    order, counts = moe.sort_by_expert(ids, 5)
    assert counts.tolist() == [3, 1, 2, 2, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert order.tolist()[:3] == [1, 2, 7]  # stable: token order kept within an expert


def test_unused_experts_and_empty_batch():
    block = hf_block("mixtral", 2)
    w = our_weights(block, "mixtral", True)
    x = torch.randn(0, HIDDEN)
    assert moe.moe_forward(x, w).shape == (0, HIDDEN)
    one = torch.randn(1, HIDDEN)  # one token: at most 2 of the 6 experts run
    with torch.no_grad():
        torch.testing.assert_close(moe.moe_forward(one, w), block(one[None])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_partials_sum_to_the_whole(size):
    block = hf_block("qwen3_moe", 2, norm_topk_prob=False)
    w = our_weights(block, "qwen3_moe", False)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(5))
    total = torch.zeros(11, HIDDEN)
    for rank in range(size):
        start, stop = moe.expert_slice(INTER, rank, size)
        gate_up = torch.cat([w.gate_up[:, start:stop], w.gate_up[:, INTER + start:INTER + stop]], dim=1)
        down = w.down[:, :, start:stop]
        assert gate_up.shape == (EXPERTS, 2 * INTER // size, HIDDEN) and down.shape == (EXPERTS, HIDDEN, INTER // size)
        total += moe.moe_forward(x, moe.MoEWeights(w.router, gate_up, down, w.top_k, w.norm_topk_prob))
    torch.testing.assert_close(total, moe.moe_forward(x, w), rtol=1e-5, atol=1e-6)


def test_shard_refuses_an_indivisible_intermediate_size():
    with pytest.raises(ValueError, match="tensor-parallel-size 5 does not divide .* 48"):
        moe.expert_slice(INTER, 0, 5)


def test_stack_experts_matches_transformers_layout():
    g = torch.Generator().manual_seed(6)
    gate = [torch.randn(INTER, HIDDEN, generator=g) for _ in range(3)]
    up = [torch.randn(INTER, HIDDEN, generator=g) for _ in range(3)]
    down = [torch.randn(HIDDEN, INTER, generator=g) for _ in range(3)]
    gate_up, stacked_down = moe.stack_experts(gate, up, down)
    assert gate_up.shape == (3, 2 * INTER, HIDDEN) and stacked_down.shape == (3, HIDDEN, INTER)
    assert torch.equal(gate_up[1, :INTER], gate[1]) and torch.equal(gate_up[1, INTER:], up[1])
    assert torch.equal(stacked_down[2], down[2])
