"""The Triton fused-MoE kernel against the torch path (worker_svc.model.layers.moe.experts_torch); on CPU under
TRITON_INTERPRET=1 (tests/conftest.py sets it), so the shapes stay small."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import fused_moe  # noqa: E402
from worker_svc.model.layers import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not fused_moe.INTERPRET:
    raise RuntimeError("kernels.fused_moe was imported without TRITON_INTERPRET=1 and there is no GPU")


def make(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
         norm: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g)
    gate_up = 0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)
    down = 0.2 * torch.randn(experts, hidden, inter, generator=g)
    x, router, gate_up, down = (t.to(DEVICE, dtype) for t in (x, router, gate_up, down))
    weights, ids = moe.route(x, router, top_k, norm)
    return x, weights, ids, gate_up, down


# (tokens, experts, top_k, hidden, intermediate): decode-sized and prefill-sized, hidden / intermediate not
# multiples of the tiles, more experts than pairs, every expert taken.
SHAPES = [(1, 4, 2, 64, 32), (7, 4, 2, 40, 24), (33, 8, 2, 64, 48), (5, 3, 3, 32, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}_e{}_k{}_h{}_i{}".format(*s))
def test_matches_torch_path_float32(shape):
    x, weights, ids, gate_up, down = make(*shape, torch.float32)
    got = fused_moe.fused_experts(x, weights, ids, gate_up, down)
    expected = moe.experts_torch(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_matches_torch_path_bfloat16():
    x, weights, ids, gate_up, down = make(9, 4, 2, 64, 32, torch.bfloat16, seed=1)
    got = fused_moe.fused_experts(x, weights, ids, gate_up, down)
    assert got.dtype == torch.bfloat16
    expected = moe.experts_torch(x.float(), weights, ids, gate_up.float(), down.float())
    # bfloat16 rounds the gate/up result and the output (and the interpreter's casts truncate): compare the error
    # with the output's scale.
    assert (got.float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_unnormalised_weights_and_no_tokens():
    x, weights, ids, gate_up, down = make(6, 4, 2, 32, 16, torch.float32, seed=2, norm=False)
    torch.testing.assert_close(fused_moe.fused_experts(x, weights, ids, gate_up, down),
                               moe.experts_torch(x, weights, ids, gate_up, down), rtol=1e-4, atol=1e-5)
    empty = fused_moe.fused_experts(x[:0], weights[:0], ids[:0], gate_up, down)
    assert empty.shape == (0, 32)


def test_align_by_expert_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]], device=DEVICE)  # expert 0: 2 pairs, 1: 1, 2: 3, 3: none
    pairs, block_expert = fused_moe.align_by_expert(ids, 4, 4)
    sentinel = ids.numel()
    assert pairs.tolist()[:12] == [1, 2, sentinel, sentinel, 5, sentinel, sentinel, sentinel,
                                   0, 3, 4, sentinel]
    assert block_expert.tolist()[:3] == [0, 1, 2]
    assert all(e == 4 for e in block_expert.tolist()[3:])  # tiles past the end belong to no expert
    assert len(pairs) % 4 == 0 and len(pairs) >= 12
