"""The torch paged-attention backend's attention sinks (gpt-oss: one learned logit per query head in the softmax
denominator) against a dense float64 reference, alone and with sliding windows smaller than a block, equal to one
and longer than every context, and with soft-capping; a sink shape that does not fit is refused naming `sinks`."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention
from tests.unit.test_attention_window import dense_windowed
from tests.unit.test_reference_attention import cu_seqlens, make_batch

BLOCK = 16
# Decodes of several lengths (grouped, some padded), prefill chunks with cached context, a whole prompt.
SHAPES = [(1, 150), (1, 40), (1, 3), (5, 18), (33, 97), (20, 45), (24, 24)]


def head_sinks(num_heads: int, seed: int = 5) -> torch.Tensor:
    """Sinks from well below to well above typical scores, so that some heads give the sink most weight."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 3.0).float()


@pytest.mark.parametrize("window,softcap", [
    (None, None),
    (1, None),       # each query sees itself and the sink
    (7, None),       # smaller than a block
    (BLOCK, None),   # exactly one block
    (1000, None),    # longer than every context
    (BLOCK, 2.0),    # with soft-capping
])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_sinks_match_dense(window, softcap, heads):
    query, kc, vc, _, padded, dense = make_batch(SHAPES, *heads, 32, BLOCK, seed=3)
    scale = 32 ** -0.5
    sinks = head_sinks(heads[0])
    lens = torch.tensor([s for _, s in SHAPES], dtype=torch.int32)
    out = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES), lens, scale, sliding_window=window,
                          softcap=softcap, sinks=sinks)
    expected = dense_windowed(query, SHAPES, dense, scale, window, softcap, sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    # The sinks change the output (not a no-op), and a sink far below every score is no sink at all.
    plain = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES), lens, scale, sliding_window=window,
                            softcap=softcap)
    assert (out - plain).abs().max() > 1e-2
    silent = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES), lens, scale, sliding_window=window,
                             softcap=softcap, sinks=torch.full((heads[0],), -1e4))
    torch.testing.assert_close(silent, plain, atol=2e-5, rtol=2e-5)


def test_bfloat16_queries_with_sinks():
    query, kc, vc, _, padded, dense = make_batch(SHAPES[:4], 4, 2, 32, BLOCK, dtype=torch.bfloat16, seed=8)
    sinks = head_sinks(4)
    lens = torch.tensor([s for _, s in SHAPES[:4]], dtype=torch.int32)
    out = paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES[:4]), lens, 0.2, sinks=sinks, sliding_window=9)
    assert out.dtype == torch.bfloat16
    expected = dense_windowed(query, SHAPES[:4], dense, 0.2, 9, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(2,), (4, 1), (8,)])
def test_wrong_sink_shape_refused_naming_it(shape):
    query, kc, vc, _, padded, _ = make_batch(SHAPES[:2], 4, 2, 32, BLOCK, seed=1)
    lens = torch.tensor([s for _, s in SHAPES[:2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \(4,\)"):
        paged_attention(query, kc, vc, padded, cu_seqlens(SHAPES[:2]), lens, 0.2, sinks=torch.zeros(shape))
