"""Where a CPU step's 30 decoder layers spend their time, kernel by kernel: each of the C++ kernels the layer loop
calls (kernels/csrc), called 30 times with the bundled model's own weights (each layer's, from memory) on the shapes of
one step, and timed alone. The numbers in experiments/results/peers-2026-12-06-wave21.md. To compare revisions, run
each checkout's copy of this file from outside both trees (`cd /tmp; PYTHONPATH=<checkout> python -m
experiments.layer_ops`), alternating: one process can load only one build of the kernels.

Steps: `decode:N@C` (N decodes, each at context C) and `prefill:N@L` (N prompts of L tokens in one step, every row
seeing its own prefix). The KV cache is random (attention reads it in place; the values do not change the time).

    .venv/bin/python -m experiments.layer_ops [--steps decode:64@160,prefill:4@128]

bfloat16 only (the panels, swiglu joined): an AVX-512 CPU.
"""

from __future__ import annotations

import argparse

import torch

from experiments.decode_attention_layers import median_ms
from worker_svc.config import WorkerConfig
from worker_svc.core.runner import ModelRunner
from worker_svc.model.loader import default_model_path

BLOCK = 16


def step_rows(seqs: int, context: int, rows_per_seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows, block tables and seq_lens of the attention kernel's rows: sequence s holds blocks [s * per, (s + 1) * per)
    and its rows are the last `rows_per_seq` positions of its `context`."""
    per = -(-context // BLOCK)
    seq = torch.arange(seqs).repeat_interleave(rows_per_seq)
    tables = (seq[:, None] * per + torch.arange(per)).int()
    lens = (context - rows_per_seq + 1 + torch.arange(rows_per_seq).repeat(seqs)).int()
    return torch.arange(len(seq)), tables, lens


def layer_ops(ops: object, model: object, seqs: int, context: int, rows_per_seq: int, repeats: int) -> dict[str, float]:
    c, layers = model.config, model.layers
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    rows, tables, lens = step_rows(seqs, context, rows_per_seq)
    t = len(rows)
    blocks = seqs * -(-context // BLOCK)
    kv = torch.randn(len(layers), 2, blocks, BLOCK, hkv, d).to(model.dtype)
    h = torch.randn(t, c.hidden_size).to(model.dtype)
    x = ops.rms_norm(h, layers[0].input_norm, c.rms_norm_eps)
    qkv = ops.dense_matmul(x, layers[0].qkv.panels, layers[0].qkv.out_features, None, None)
    qk = qkv.narrow(1, 0, (hq + hkv) * d).view(t, hq + hkv, d)
    v = qkv.narrow(1, (hq + hkv) * d, hkv * d).view(t, hkv, d)
    q, out = qk.narrow(1, 0, hq), torch.empty(t, hq, d, dtype=model.dtype)
    slots = torch.arange(t)
    positions = (lens - 1).long()
    gate_up = [torch.stack([g.gate.panels, g.up.panels], 1).flatten(0, 1) for g in layers]  # as cpu_layers joins them
    act = ops.dense_swiglu(x, gate_up[0], layers[0].gate.out_features)
    each = {
        "rms_norm x2": lambda: [ops.rms_norm(h, g.input_norm, c.rms_norm_eps) for g in layers for _ in range(2)],
        "qkv": lambda: [ops.dense_matmul(x, g.qkv.panels, g.qkv.out_features, None, None) for g in layers],
        "rope": lambda: [ops.rope_(qk, positions, model.cos_cache, model.sin_signed_cache) for _ in layers],
        "write_kv": lambda: [ops.write_kv(qk.narrow(1, hq, hkv), v, kv[i, 0], kv[i, 1], slots)
                             for i in range(len(layers))],
        "attention": lambda: [ops.decode_attention(q, rows, kv[i, 0], kv[i, 1], tables, lens, model.scale, 0, 0.0,
                                                   None, out) for i in range(len(layers))],
        "o + residual": lambda: [ops.dense_matmul(out.view(t, -1), g.o.panels, g.o.out_features, None, h)
                                 for g in layers],
        "gate_up (swiglu)": lambda: [ops.dense_swiglu(x, w, g.gate.out_features)
                                     for g, w in zip(layers, gate_up, strict=True)],
        "down + residual": lambda: [ops.dense_matmul(act, g.down.panels, g.down.out_features, None, h)
                                    for g in layers],
    }
    return {name: median_ms(fn, repeats) for name, fn in each.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="decode:1@160,decode:16@160,decode:64@160,prefill:4@128")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = ModelRunner(WorkerConfig(model=default_model_path(), num_gpu_blocks_override=64, dtype="bfloat16")).model
    if not hasattr(model.layers[0].qkv, "panels"):
        raise SystemExit("layer_ops: the model's matmuls are not bfloat16 panels here (the CPU lacks AVX-512)")
    ops = model.cpu_ops
    for step in args.steps.split(","):
        kind, shape = step.split(":")
        seqs, length = (int(v) for v in shape.split("@"))
        ms = layer_ops(ops, model, seqs, length, length if kind == "prefill" else 1, args.repeats)
        print(f"{step:<16} {sum(ms.values()):6.1f} ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()),
              flush=True)


if __name__ == "__main__":
    main()
