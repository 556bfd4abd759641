"""The recurrent-state pool of a hybrid model: a second pool beside the paged KV, in fixed-size slots.

Slot s holds every recurrent layer's state for one sequence (or one prefix-cache snapshot): the conv window
[conv_dim, kernel - 1] in the model dtype and the recurrent matrix (Gated DeltaNet: [heads, key_dim, value_dim];
Mamba2: [heads, head_dim, state_size]) in --mamba-ssm-cache-dtype. The scheduler hands slots out; the worker only
zeroes, copies and updates them as the plan says (worker_svc/plan.py).

Sizing (--num-state-slots 0 = auto): a quarter of the KV memory budget, at least AUTO_MIN slots and at most AUTO_MAX;
the slots' bytes come out of the budget before the KV blocks are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO_SHARE = 4  # auto: 1 / AUTO_SHARE of the KV memory budget
AUTO_MIN = 8
AUTO_MAX = 1024

SSM_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's state per sequence, the same for every recurrent layer of a model."""

    num_layers: int  # recurrent layers
    conv: tuple[int, int]  # [conv_dim, kernel - 1]
    ssm: tuple[int, ...]  # the recurrent matrix, e.g. [heads, key_dim, value_dim]

    def bytes_per_slot(self, dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv[0] * self.conv[1] * dtype.itemsize
        ssm = 1
        for d in self.ssm:
            ssm *= d
        return self.num_layers * (conv + ssm * ssm_dtype.itemsize)


def ssm_dtype(name: str) -> torch.dtype:
    if name not in SSM_DTYPES:
        raise ValueError(f"--mamba-ssm-cache-dtype must be one of {', '.join(SSM_DTYPES)}; got {name!r}")
    return SSM_DTYPES[name]


def auto_num_slots(bytes_per_slot: int, budget: int) -> int:
    return max(AUTO_MIN, min(AUTO_MAX, budget // AUTO_SHARE // bytes_per_slot))


class StateCache:
    """conv [layers, slots, conv_dim, kernel - 1] and ssm [layers, slots, *ssm]: one tensor each, so a whole-slot
    copy or zeroing is one indexed assignment over all layers."""

    def __init__(self, shape: StateShape, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device):
        self.shape = shape
        self.num_slots = num_slots
        self.conv = torch.zeros(shape.num_layers, num_slots, *shape.conv, dtype=dtype, device=device)
        self.ssm = torch.zeros(shape.num_layers, num_slots, *shape.ssm, dtype=ssm_dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return self.shape.bytes_per_slot(self.conv.dtype, self.ssm.dtype)

    def zero(self, slots: torch.Tensor) -> None:
        """A fresh sequence starts from zero state."""
        if len(slots):
            self.conv[:, slots] = 0
            self.ssm[:, slots] = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Whole slots src[i] -> dst[i] (all reads before any write, so chains and swaps are exact)."""
        if len(src):
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]


@dataclass
class StateStep:
    """What a hybrid forward needs beyond the attention metadata: the pool, and per sequence of the step (in the
    order of its rows) its slot and its rows [cu_seqlens[i], cu_seqlens[i + 1])."""

    cache: StateCache
    slots: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [N + 1] int64
