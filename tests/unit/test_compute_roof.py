"""experiments/compute_roof.py counts one request's matmul multiply-adds from SmolLM2-135M's shapes: the count must
be the bundled GGUF's own matmul weights (30 layers' q, k, v, o, gate, up, down and the tied embedding as the head)."""

from __future__ import annotations

import gguf

from experiments.compute_roof import request_macs
from worker_svc.model.loader import default_model_path


def test_request_macs_match_the_bundled_weights():
    sizes = {t.name: int(t.n_elements) for t in gguf.GGUFReader(default_model_path()).tensors}
    layers = sum(n for name, n in sizes.items() if name.startswith("blk.") and name.rsplit(".", 2)[-2] in
                 {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    assert request_macs(1, 1) == layers + head  # one prompt token through the layers and the head
    # 128 prompt tokens through the layers, the head for the last; 63 more tokens through both
    assert request_macs(128, 64) == 128 * layers + head + 63 * (layers + head)
