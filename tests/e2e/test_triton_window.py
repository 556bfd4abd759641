"""The Triton paged-attention kernel's sliding window and soft-capping against the torch backend's (both
per-layer options of the model's attention call), at windows smaller than, equal to and larger than a block and
longer than the context. Small shapes: on CPU this runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_triton_attention import _batch, _check, ref, tri  # sets TRITON_INTERPRET=1 first without a GPU
from tests.unit.test_attention_window import dense_windowed

SHAPES = [(1, 40), (1, 7), (6, 23), (17, 17)]


@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (21, 4.0), (500, None), (16, 50.0)])
def test_window_softcap_equal_torch_backend_and_dense(window, softcap):
    (q, kc, vc, tables, cu, lens), dense = _batch(SHAPES, (4, 2), 32, 16, torch.float32, seed=11)
    scale = 32 ** -0.5
    out = tri.paged_attention(q, kc, vc, tables, cu, lens, scale, sliding_window=window, softcap=softcap)
    torch_backend = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), cu.cpu(), lens.cpu(), scale,
                                        sliding_window=window, softcap=softcap)
    expected = dense_windowed(q.cpu(), SHAPES, dense, scale, window, softcap)
    _check(out.cpu(), expected, torch.float32, f"window {window} softcap {softcap}")
    _check(torch_backend, expected, torch.float32, "torch backend")


def test_gemma2_model_on_triton_equals_torch_backend(tmp_path):
    """A whole Gemma 2 (sliding and global layers, soft-capped scores) on the Triton kernel: a chunked prefill
    past the window, then decodes; logits as the torch backend's."""
    from tests.service.test_model import PagedRunner
    from tests.service.test_model_families import make_checkpoint, prompts
    from worker_svc.model import families as models
    from worker_svc.model.loader import load_hf_dir

    make_checkpoint("gemma2", tmp_path)
    config, weights = load_hf_dir(str(tmp_path))
    runners = [PagedRunner(models.by_name(config.architecture)(config, weights, torch.float32, "cpu",
                                                               attention=backend), num_blocks=16)
               for backend in (ref, tri)]
    ids = prompts(config.vocab_size, (30, 9))
    steps = [{0: ids[0][:20], 1: ids[1]}, {0: ids[0][20:], 1: [5]}, {0: [7], 1: [8]}]
    for chunks in steps:
        want, got = (r.step(chunks, all_logits=True) for r in runners)
        _check(got, want, torch.float32, "gemma2 on triton")
