"""The recurrent layers' Triton decode kernels (kernels/recurrent_triton.py; in the interpreter without a GPU)
against the torch path: the gated delta rule's update, Mamba2's scan step and the conv window's shift, in place on
pool slots."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.recurrent_triton import conv1d_decode, gated_delta_rule_decode, ssd_decode  # noqa: E402
from worker_svc.model.layers.causal_conv import causal_conv1d  # noqa: E402
from worker_svc.model.layers.gated_delta_rule import _recurrent_step  # noqa: E402
from worker_svc.model.layers.ssd_scan import _recurrent_step as _ssd_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n, heads, dk, dv", [(1, 2, 8, 8), (5, 4, 12, 6)])
def test_delta_rule_decode_matches_torch(n, heads, dk, dv):
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dk, generator=g)
    v, decay, beta = torch.randn(n, heads, dv, generator=g), -torch.rand(n, heads, generator=g), torch.rand(n, heads)
    states = torch.randn(9, heads, dk, dv, generator=g)
    slots = torch.randperm(9, generator=g)[:n]
    want_states = states.clone()
    want = _recurrent_step(q, k, v, decay, beta, want_states, slots)
    got_states = states.to(DEVICE)
    got = gated_delta_rule_decode(*(t.to(DEVICE) for t in (q, k, v, decay, beta)), got_states, slots.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states.cpu(), want_states, rtol=1e-5, atol=1e-5)  # the others untouched too


@pytest.mark.parametrize("n, channels, kernel, bias", [(1, 16, 4, True), (6, 300, 4, False), (3, 20, 2, True)])
def test_conv_decode_matches_torch(n, channels, kernel, bias):
    g = torch.Generator().manual_seed(channels)
    x, weight = torch.randn(n, channels, generator=g), torch.randn(channels, kernel, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    states = torch.randn(7, channels, kernel - 1, generator=g)
    slots = torch.randperm(7, generator=g)[:n]
    want_states = states.clone()
    want = causal_conv1d(x, weight, b, want_states, slots, torch.arange(n + 1))
    got_states = states.to(DEVICE)
    got = conv1d_decode(x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE), got_states,
                        slots.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states.cpu(), want_states)


@pytest.mark.parametrize("n, heads, p, n_state", [(1, 2, 8, 4), (4, 3, 6, 10)])
def test_ssd_decode_matches_torch(n, heads, p, n_state):
    g = torch.Generator().manual_seed(p)
    x, dt = torch.randn(n, heads, p, generator=g), torch.rand(n, heads, generator=g) * 0.5
    a = -torch.rand(heads, generator=g)
    b, c = torch.randn(n, heads, n_state, generator=g), torch.randn(n, heads, n_state, generator=g)
    states = torch.randn(6, heads, p, n_state, generator=g)
    slots = torch.randperm(6, generator=g)[:n]
    want_states = states.clone()
    want = _ssd_step(x, dt, a, b, c, want_states, slots)
    got_states = states.to(DEVICE)
    got = ssd_decode(*(t.to(DEVICE) for t in (x, dt, a, b, c)), got_states, slots.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states.cpu(), want_states, rtol=1e-5, atol=1e-5)
