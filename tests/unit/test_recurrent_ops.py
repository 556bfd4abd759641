"""The recurrent layers' ops (worker_svc/causal_conv.py, gated_delta_rule.py, ssd_scan.py) against transformers'
own torch functions on random inputs: several sequences of different lengths in one flattened step, and a state
carried across a split of each sequence (chunked prefill, then decode tokens); the step's decode / chunk split
(recurrent_split.py), made once from host data, is all the scans read of the step's layout."""

from __future__ import annotations

import pytest
import torch
from transformers.models.nemotron_h import modeling_nemotron_h as hf_mamba
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from worker_svc.model.layers.causal_conv import causal_conv1d
from worker_svc.model.layers.gated_delta_rule import gated_delta_rule
from worker_svc.model.layers.recurrent_split import RecurrentSplit
from worker_svc.model.layers.ssd_scan import ssd_scan

LENGTHS = (37, 1, 70, 5)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _split_runs(total: list[int], cuts: list[int]):
    """Each sequence's rows split at `cuts[i]`: first the parts before, then after (two steps)."""
    return [c for c in cuts], [t - c for t, c in zip(total, cuts, strict=True)]


def test_causal_conv_matches_hf_across_a_split():
    torch.manual_seed(0)
    channels, kernel = 12, 4
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    seqs = [torch.randn(n, channels) for n in LENGTHS]
    expected = [hf.causal_conv1d_fn(s.T.unsqueeze(0), weight, bias, activation="silu")[0].T for s in seqs]
    states = torch.full((6, channels, kernel - 1), float("nan"))
    slots = torch.tensor([4, 0, 2, 5])
    states[slots] = 0.0
    first, second = _split_runs(list(LENGTHS), [30, 0, 1, 3])
    got = [[] for _ in seqs]
    for part, offset in ((first, [0] * 4), (second, first)):
        on = [i for i, n in enumerate(part) if n]
        x = torch.cat([seqs[i][offset[i]:offset[i] + part[i]] for i in on])
        y = causal_conv1d(x, weight, bias, states, slots[on], _cu([part[i] for i in on]))
        for i, chunk in zip(on, y.split([part[i] for i in on]), strict=True):
            got[i].append(chunk)
    for i, e in enumerate(expected):
        torch.testing.assert_close(torch.cat(got[i]), e, atol=1e-5, rtol=1e-5)
        # the carried window is the sequence's last kernel - 1 inputs (zeros before its start)
        tail = torch.cat([torch.zeros(kernel - 1, channels), seqs[i]])[-(kernel - 1):]
        torch.testing.assert_close(states[slots[i]], tail.T)


@pytest.mark.parametrize("cuts", [[37, 1, 70, 5], [30, 0, 64, 4], [1, 0, 7, 2]])
def test_gated_delta_rule_matches_hf_across_a_split(cuts):
    torch.manual_seed(1)
    hk, hv, dk, dv = 2, 4, 8, 6
    seqs = []
    for n in LENGTHS:
        seqs.append(dict(q=torch.randn(n, hk, dk), k=torch.randn(n, hk, dk), v=torch.randn(n, hv, dv),
                         g=-torch.rand(n, hv) * 2, beta=torch.rand(n, hv)))
    initial = torch.randn(len(LENGTHS), hv, dk, dv) * 0.1
    expected = []
    for i, s in enumerate(seqs):
        o, final = hf.torch_chunk_gated_delta_rule(*(s[x].unsqueeze(0) for x in "qkv"), g=s["g"].unsqueeze(0),
                                                   beta=s["beta"].unsqueeze(0), initial_state=initial[i:i + 1],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        expected.append((o[0], final[0]))
    states = torch.full((7, hv, dk, dv), float("nan"))
    slots = torch.tensor([6, 1, 3, 0])
    states[slots] = initial
    first, second = _split_runs(list(LENGTHS), cuts)
    got = [[] for _ in seqs]
    for part, offset in ((first, [0] * 4), (second, first)):
        on = [i for i, n in enumerate(part) if n]
        if not on:
            continue
        args = [torch.cat([seqs[i][x][offset[i]:offset[i] + part[i]] for i in on]) for x in ("q", "k", "v", "g",
                                                                                              "beta")]
        o = gated_delta_rule(*args, states, slots[on], _cu([part[i] for i in on]))
        for i, chunk in zip(on, o.split([part[i] for i in on]), strict=True):
            got[i].append(chunk)
    for i, (o, final) in enumerate(expected):
        torch.testing.assert_close(torch.cat(got[i]), o, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[slots[i]], final, atol=2e-5, rtol=1e-4)


def test_gated_delta_rule_decode_matches_hf_recurrent():
    torch.manual_seed(2)
    n, hk, hv, dk, dv = 3, 1, 2, 4, 4
    q, k = torch.randn(n, hk, dk), torch.randn(n, hk, dk)
    v, g, beta = torch.randn(n, hv, dv), -torch.rand(n, hv), torch.rand(n, hv)
    initial = torch.randn(n, hv, dk, dv)
    states = initial.clone()
    o = gated_delta_rule(q, k, v, g, beta, states, torch.arange(n), torch.arange(n + 1))
    for i in range(n):
        e, final = hf.torch_recurrent_gated_delta_rule(q[i:i + 1, None], k[i:i + 1, None], v[i:i + 1, None],
                                                       g=g[i:i + 1, None], beta=beta[i:i + 1, None],
                                                       initial_state=initial[i:i + 1], output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[i], e[0, 0])
        torch.testing.assert_close(states[i], final[0])


@pytest.mark.parametrize("cuts", [[37, 1, 70, 5], [30, 0, 64, 4], [1, 0, 7, 2]])
def test_ssd_scan_matches_hf_across_a_split(cuts):
    torch.manual_seed(3)
    heads, groups, p, n_state = 4, 2, 6, 5
    a = -torch.rand(heads) * 2 - 0.1
    d = torch.randn(heads)
    seqs = [dict(x=torch.randn(n, heads, p), dt=torch.rand(n, heads) * 0.5 + 0.01, b=torch.randn(n, groups, n_state),
                 c=torch.randn(n, groups, n_state)) for n in LENGTHS]
    initial = torch.randn(len(LENGTHS), heads, p, n_state) * 0.1
    expected = []
    for i, s in enumerate(seqs):
        y, final = hf_mamba.mamba2_chunk_scan(s["x"][None], s["dt"][None], a, s["b"][None], s["c"][None],
                                              chunk_size=16, D=d, initial_states=initial[i:i + 1],
                                              return_final_states=True)
        expected.append((y[0], final[0]))
    states = torch.full((7, heads, p, n_state), float("nan"))
    slots = torch.tensor([6, 1, 3, 0])
    states[slots] = initial
    first, second = _split_runs(list(LENGTHS), cuts)
    got = [[] for _ in seqs]
    for part, offset in ((first, [0] * 4), (second, first)):
        on = [i for i, n in enumerate(part) if n]
        if not on:
            continue
        args = [torch.cat([seqs[i][k][offset[i]:offset[i] + part[i]] for i in on]) for k in ("x", "dt", "b", "c")]
        x, dt, b, c = args
        y = ssd_scan(x, dt, a, b, c, d, states, slots[on], _cu([part[i] for i in on]))
        for i, chunk in zip(on, y.split([part[i] for i in on]), strict=True):
            got[i].append(chunk)
    for i, (y, final) in enumerate(expected):
        torch.testing.assert_close(torch.cat(got[i]), y, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[slots[i]], final, atol=2e-5, rtol=1e-4)


def test_split_from_the_plans_lengths_equals_the_one_read_from_cu_seqlens():
    lengths = [37, 1, 70, 1, 5]
    host, read = RecurrentSplit.of_lengths(lengths, "cpu"), RecurrentSplit.of_cu_seqlens(_cu(lengths))
    assert host.decode_seqs.tolist() == read.decode_seqs.tolist() == [1, 3]
    assert host.decode_rows.tolist() == [37, 108]
    assert host.chunks.seqs.tolist() == [0, 2, 4] and host.chunks.size == 64
    assert [m.tolist() for _, m in host.chunks.rounds] == [[0, 1, 3], [2]]  # 70 rows: the only second block
    assert torch.equal(host.chunks.rows, read.chunks.rows) and torch.equal(host.chunks.valid, read.chunks.valid)
    assert RecurrentSplit.of_lengths([1, 1], "cpu").chunks is None
    assert RecurrentSplit.of_lengths([3], "cpu").decode_rows is None


def test_given_the_steps_split_the_scans_never_read_cu_seqlens():
    """The per-step split is all the scans read of the step's layout: cu_seqlens on the meta device (any read of its
    values would raise) gives the same bits as the real one (on CUDA each read would be a host sync per layer)."""
    lengths = [37, 1, 70, 5, 1]
    cu, unreadable = _cu(lengths), torch.empty(len(lengths) + 1, dtype=torch.int64, device="meta")
    split = RecurrentSplit.of_lengths(lengths, "cpu")
    t, slots = sum(lengths), torch.tensor([6, 1, 3, 0, 4])
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g), torch.randn(t, 4, 6, generator=g)
    decay, beta = -torch.rand(t, 4, generator=g), torch.rand(t, 4, generator=g)
    pool = torch.randn(7, 4, 8, 6, generator=g)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_rule(q, k, v, decay, beta, want_pool, slots, cu)
    got = gated_delta_rule(q, k, v, decay, beta, got_pool, slots, unreadable, split)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    x, dt = torch.randn(t, 4, 6, generator=g), torch.rand(t, 4, generator=g)
    a, d = -torch.rand(4, generator=g), torch.randn(4, generator=g)
    b, c = torch.randn(t, 2, 5, generator=g), torch.randn(t, 2, 5, generator=g)
    pool = torch.randn(7, 4, 6, 5, generator=g)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = ssd_scan(x, dt, a, b, c, d, want_pool, slots, cu)
    got = ssd_scan(x, dt, a, b, c, d, got_pool, slots, unreadable, split)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
