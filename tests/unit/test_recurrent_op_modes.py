"""The recurrent layer ops (worker_svc/model/layers/: CausalConv1d, GatedDeltaRule, SSDScan) in CUDA mode send a
mixed step's decode rows to the Triton kernels (in the interpreter without a GPU) and its longer chunks to torch,
and agree with the native (torch) mode on the outputs and the pool."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker_svc.model.layers.causal_conv import CausalConv1d  # noqa: E402
from worker_svc.model.layers.gated_delta_rule import GatedDeltaRule  # noqa: E402
from worker_svc.model.layers.op import CUDA, NATIVE  # noqa: E402
from worker_svc.model.layers.ssd_scan import SSDScan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CU = torch.tensor([0, 1, 6, 7])  # decode, a 5-token chunk, decode
SLOTS = torch.tensor([4, 0, 2])


def both_modes(op_cls, args: list, states: torch.Tensor, pool_at: int):
    """(native output, native pool), (cuda-mode output, cuda-mode pool) from the same inputs."""
    out = []
    for mode, device in ((NATIVE, "cpu"), (CUDA, DEVICE)):
        pool = states.clone().to(device)
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        moved.insert(pool_at, pool)
        out.append((op_cls(mode)(*moved).cpu(), pool.cpu()))
    return out


def test_delta_rule_op_modes_agree():
    g = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 7, 2, 4, 8, 6
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    states = torch.randn(5, hv, dk, dv, generator=g)
    (want, want_pool), (got, got_pool) = both_modes(GatedDeltaRule, [q, k, v, decay, beta, SLOTS, CU], states, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)


def test_ssd_scan_op_modes_agree():
    g = torch.Generator().manual_seed(1)
    t, heads, p, groups, n = 7, 4, 6, 2, 8
    x, dt = torch.randn(t, heads, p, generator=g), torch.rand(t, heads, generator=g)
    a, d = -torch.rand(heads, generator=g), torch.randn(heads, generator=g)
    b, c = torch.randn(t, groups, n, generator=g), torch.randn(t, groups, n, generator=g)
    states = torch.randn(5, heads, p, n, generator=g)
    (want, want_pool), (got, got_pool) = both_modes(SSDScan, [x, dt, a, b, c, d, SLOTS, CU], states, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cu", [CU, torch.arange(4)])  # a mixed step (torch in both modes); a decode step (Triton)
def test_conv_op_modes_agree(cu):
    g = torch.Generator().manual_seed(2)
    channels, kernel = 20, 4
    x, weight = torch.randn(int(cu[-1]), channels, generator=g), torch.randn(channels, kernel, generator=g)
    bias = torch.randn(channels, generator=g)
    states = torch.randn(5, channels, kernel - 1, generator=g)
    (want, want_pool), (got, got_pool) = both_modes(CausalConv1d, [x, weight, bias, SLOTS, cu], states, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)
