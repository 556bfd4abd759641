"""The torch paged-attention backend's sliding window and soft-capping against a dense per-sequence reference:
windows smaller than a block, equal to one, spanning several, and longer than every context."""

from __future__ import annotations

import pytest
import torch

from kernels import build_reference_plan, paged_attention
from tests.unit.test_reference_attention import cu_seqlens, make_batch

BLOCK = 16
# Decodes of several lengths (grouped together, some padded), prefill chunks with cached context, a whole prompt.
SHAPES = [(1, 150), (1, 40), (1, 3), (5, 18), (33, 97), (20, 45), (24, 24)]


def dense_windowed(query, shapes, dense, scale, window=None, softcap=None, sinks=None):
    """float64, one query row at a time over exactly the keys it may see: positions (pos - window, pos]. sinks
    [Hq]: one more score column per head whose value row is zero, so it enters the denominator only."""
    outs, row = [], 0
    for (q_len, s), (k, v) in zip(shapes, dense, strict=True):
        group = query.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [s, Hq, D]
        for pos in range(s - q_len, s):
            first = max(0, pos - window + 1) if window else 0
            scores = torch.einsum("hd,khd->hk", query[row].double(), kk[first:pos + 1]) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            p = torch.softmax(scores if sinks is None else torch.cat([scores, sinks.double()[:, None]], 1), -1)
            outs.append(torch.einsum("hk,khd->hd", p[:, :scores.shape[1]], vv[first:pos + 1]))
            row += 1
    return torch.stack(outs)


@pytest.mark.parametrize("window,softcap", [
    (1, None),       # each query sees only itself
    (7, None),       # smaller than a block
    (BLOCK, None),   # exactly one block
    (40, None),      # across blocks
    (1000, None),    # longer than every context: plain causal
    (None, 5.0),
    (BLOCK, 0.7),    # both, strong capping
    (1000, 30.0),
])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_window_and_softcap_match_dense(window, softcap, heads):
    query, kc, vc, _, padded, dense = make_batch(SHAPES, *heads, 32, BLOCK, seed=3)
    scale = 32 ** -0.5
    lens = torch.tensor([s for _, s in SHAPES], dtype=torch.int32)
    out = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES), lens, scale, sliding_window=window,
                          softcap=softcap)
    expected = dense_windowed(query, SHAPES, dense, scale, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_one_plan_serves_layers_of_different_windows():
    """A step's plan is shared by every layer: a global layer after a sliding one must see the whole context."""
    query, kc, vc, _, padded, dense = make_batch(SHAPES, 4, 2, 32, BLOCK, seed=4)
    lens = [s for _, s in SHAPES]
    plan = build_reference_plan(padded, [q for q, _ in SHAPES], lens, BLOCK)
    args = (query, kc, vc, padded, cu_seqlens(SHAPES), torch.tensor(lens, dtype=torch.int32), 0.2)
    for window in (8, None, 8, 33, None):
        out = paged_attention(*args, plan=plan, sliding_window=window)
        torch.testing.assert_close(out.double(), dense_windowed(query, SHAPES, dense, 0.2, window),
                                   atol=2e-5, rtol=2e-5)


def test_bfloat16_softcap():
    query, kc, vc, _, padded, dense = make_batch(SHAPES, 4, 2, 32, BLOCK, dtype=torch.bfloat16, seed=6)
    lens = torch.tensor([s for _, s in SHAPES], dtype=torch.int32)
    out = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES), lens, 0.2, sliding_window=10, softcap=2.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_windowed(query, SHAPES, dense, 0.2, 10, 2.0),
                               atol=3e-2, rtol=3e-2)
