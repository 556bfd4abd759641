"""The paged KV pool: one tensor [num_kv_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

Only attention layers hold KV: a hybrid model's recurrent layers keep a fixed-size state instead
(worker_svc/state_cache.py), so its KV per token counts only its attention layers.
"""

from __future__ import annotations

import math
import mmap

import torch

from worker_svc.model.config import ModelConfig

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers that attend over the paged KV (all of them for a non-hybrid model)."""
    if cfg.layer_types is None:
        return list(range(cfg.num_layers))
    return [i for i, t in enumerate(cfg.layer_types) if t in ATTENTION_LAYER_TYPES]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return len(attention_layers(cfg)) * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def num_blocks_for_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget: int) -> int:
    return max(0, budget // bytes_per_block(cfg, block_size, dtype))


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes left for KV under `utilization` of the GPU after weights and the warm-up peak."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    return int(total * utilization) - used_by_others - peak


def allocate(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    # Zero-filled: unwritten slots must not hold NaN garbage the attention could read by mistake.
    shape = (len(attention_layers(cfg)), 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cpu":
        return zeroed_host_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor on fresh private anonymous pages, which the kernel hands out zeroed on first touch:
    torch.zeros writes every byte up front (1.6 s of CPU for the bundled model's 2 GiB float32 pool at each worker
    start, and the whole pool resident before any request), here a block costs memory once a step writes it."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps `pages` alive
