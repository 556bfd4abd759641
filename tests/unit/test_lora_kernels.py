"""The batched LoRA delta: the Triton shrink/expand kernels (in the interpreter without a GPU) and the CPU path
grouped by adapter, against a per-token reference, on small shapes with rows of mixed adapters and base rows."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.lora_triton import lora_expand, lora_shrink  # noqa: E402
from worker_svc.model.config import ModelConfig  # noqa: E402
from worker_svc.model.lora import GROUPS, LoraPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, a, b, slots, y):
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += b[s].float() @ (a[s].float() @ x[t].float())
    return out


@pytest.mark.parametrize("T,K,R,N", [(1, 64, 8, 64), (7, 100, 24, 70), (13, 576, 16, 192)])
def test_triton_shrink_expand_match_reference(T, K, R, N):
    g = torch.Generator().manual_seed(T)
    S = 3
    x, a, b = torch.randn(T, K, generator=g), torch.randn(S, R, K, generator=g), torch.randn(S, N, R, generator=g)
    slots = torch.randint(-1, S, (T,), generator=g)
    y = torch.randn(T, N, generator=g)
    want = reference(x, a, b, slots, y)
    x, a, b, slots, y = (t.to(DEVICE) for t in (x, a, b, slots, y))
    lora_expand(lora_shrink(x, a, slots), b, slots, y)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-4)


def _pool(max_loras: int) -> LoraPool:
    cfg = ModelConfig("llama", vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    pool = LoraPool(cfg, max_loras=max_loras, max_rank=4, max_cpu_loras=max_loras, dtype=torch.float32,
                    device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for group in GROUPS:  # random contents stand in for written adapters
        pool.a[group].copy_(torch.randn(pool.a[group].shape, generator=g))
        pool.b[group].copy_(torch.randn(pool.b[group].shape, generator=g))
    return pool


@pytest.mark.parametrize("row_slots", [[-1, -1, -1], [1, 1, 1], [0, -1, 2, 1], [2, 0, -1, 0, 2]])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_pool_delta_grouped_by_adapter_matches_per_token(row_slots, kernel):
    pool = _pool(3)
    rows = np.arange(len(row_slots), dtype=np.int64)
    pool.set_rows(rows, np.array(row_slots, dtype=np.int64))
    lengths = np.arange(1, len(rows) + 1, dtype=np.int64)  # chunks of 1, 2, 3... tokens
    pool.begin_step(rows, lengths)
    token_slots = torch.from_numpy(np.repeat(np.array(row_slots), lengths))
    if kernel == "triton":
        pool.token_slots = token_slots
    g = torch.Generator().manual_seed(1)
    for group in GROUPS:
        a, b = pool.a[group][1], pool.b[group][1]
        x = torch.randn(len(token_slots), a.shape[2], generator=g)
        y = torch.randn(len(token_slots), b.shape[1], generator=g)
        want = reference(x, a, b, token_slots, y)
        pool.add(1, group, x, y)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
