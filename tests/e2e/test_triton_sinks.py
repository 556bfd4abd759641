"""The Triton paged-attention kernel's attention sinks (one logit per query head in the softmax denominator,
gpt-oss) against a dense float64 reference and the torch backend: alone, with sliding windows smaller than, equal
to and larger than a block, with soft-capping, and with split-KV (the merge adds each sink once). Small shapes: on
CPU this runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_triton_attention import _batch, _check, ref, tri  # sets TRITON_INTERPRET=1 first without a GPU
from tests.unit.test_attention_sinks import head_sinks
from tests.unit.test_attention_window import dense_windowed

SHAPES = [(1, 40), (1, 7), (6, 23), (17, 17)]


@pytest.mark.parametrize("window,softcap,num_splits", [
    (None, None, 1), (5, None, 1), (16, None, 1), (500, None, 1), (21, 4.0, 1),
    (None, None, 4), (5, None, 3),  # split-KV
])
def test_sinks_equal_torch_backend_and_dense(window, softcap, num_splits):
    (q, kc, vc, tables, cu, lens), dense = _batch(SHAPES, (4, 2), 32, 16, torch.float32, seed=11)
    scale = 32 ** -0.5
    sinks = head_sinks(4)
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, scale, sliding_window=window, softcap=softcap,
                              sinks=sinks.to(q.device), num_splits=num_splits,
                              tile_n=16 if num_splits > 1 else None)  # several KV tiles to split
    torch_backend = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), scale,
                                        sliding_window=window, softcap=softcap, sinks=sinks)
    expected = dense_windowed(q.cpu(), SHAPES, dense, scale, window, softcap, sinks)
    what = f"window {window} softcap {softcap} splits {num_splits}"
    _check(out.cpu(), expected, torch.float32, what)
    _check(torch_backend, expected, torch.float32, "torch backend")


def test_wrong_sink_shape_refused_naming_it():
    (q, kc, vc, tables, cu, lens), _ = _batch(SHAPES[:1], (4, 2), 32, 16, torch.float32)
    with pytest.raises(ValueError, match="sinks must have shape"):
        tri.paged_attention(q, kc, vc, tables, cu, lens, 0.2, sinks=torch.zeros(2, device=q.device))
