"""The recurrent-state pool of a hybrid model: a second pool beside the paged KV, in fixed-size slots.

Slot s holds every recurrent layer's state for one sequence (or one prefix-cache snapshot): the conv window
[conv_dim, kernel - 1] in the model dtype and the recurrent matrix (Gated DeltaNet: [heads, key_dim, value_dim];
Mamba2: [heads, head_dim, state_size]) in --mamba-ssm-cache-dtype. The scheduler hands slots out; the worker only
zeroes, copies and updates them as the plan says (worker_svc/plan.py).

Sizing (--num-state-slots 0 = auto, `auto_num_slots`): one slot per running sequence (--max-num-seqs) plus the room
prefix-cache snapshots may take (--state-snapshot-share of all slots), never more than half the KV memory budget; the
slots' bytes come out of the budget before the KV blocks are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import ConfigError
from worker_svc.model.layers.recurrent_split import RecurrentSplit

AUTO_BUDGET_SHARE = 0.5  # auto: the state pool takes at most this share of the KV memory budget

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


def auto_num_slots(bytes_per_slot: int, budget: int, max_num_seqs: int, snapshot_share: float) -> int:
    """--num-state-slots auto. Snapshots may hold `snapshot_share` of the slots, so max_num_seqs / (1 - share) slots
    leave every running sequence its own slot while snapshots fill their share (share 1: as many as the bound
    allows). The bound, half the budget, keeps room for KV; below max_num_seqs slots the scheduler caps
    --max-num-seqs at the count."""
    fit = int(budget * AUTO_BUDGET_SHARE) // bytes_per_slot
    if fit < 1:
        raise ConfigError(f"no state slot of {bytes_per_slot} bytes fits in half the KV memory budget ({budget} "
                          "bytes): raise --kv-cache-memory (CPU) / --gpu-memory-utilization (CUDA), or set "
                          "--num-state-slots")
    if snapshot_share >= 1:
        return fit
    # the small slack keeps a float quotient such as 128.00000001 from asking for a slot more
    return min(fit, math.ceil(max_num_seqs / (1 - snapshot_share) - 1e-9))


class StateCache:
    """conv [layers, slots, conv_dim, kernel - 1] and ssm [layers, slots, *ssm]: one tensor each, so a whole-slot
    copy or zeroing is one indexed assignment over all layers."""

    def __init__(self, shape: StateShape, num_slots: int, dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device):
        self.shape = shape
        self.num_slots = num_slots
        self.conv = torch.zeros(shape.num_layers, num_slots, *shape.conv, dtype=dtype, device=device)
        self.ssm = torch.zeros(shape.num_layers, num_slots, *shape.ssm, dtype=ssm_dtype, device=device)
        self.held: tuple[list[int], torch.Tensor, torch.Tensor] | None = None  # `hold`'s slots and their state

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

    def hold(self, slots: torch.Tensor) -> None:
        """Keep a copy of these slots' state aside (speculative decoding: the state before a step's drafts), until
        the next `hold`; the memory is one slot per sequence that speculates in the step."""
        self.held = (slots.tolist(), self.conv[:, slots].clone(), self.ssm[:, slots].clone()) if len(slots) else None

    def roll_back(self, slots: torch.Tensor) -> None:
        """These slots back to the state `hold` kept aside (a step whose drafts were rejected: no draft's token
        may stay in the recurrent state)."""
        if not len(slots):
            return
        held, conv, ssm = self.held
        at = torch.tensor([held.index(s) for s in slots.tolist()], device=self.conv.device)
        self.conv[:, slots] = conv[:, at]
        self.ssm[:, slots] = ssm[:, at]


@dataclass
class StateStep:
    """What a hybrid forward needs beyond the attention metadata: the pool, and per sequence of the step (in the
    order of its rows) its slot and its rows [cu_seqlens[i], cu_seqlens[i + 1]); `split`, the decode rows and
    chunks every recurrent layer of the step takes, made once (the runner's from the plan's lengths; else from
    cu_seqlens here, one read of it)."""

    cache: StateCache
    slots: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [N + 1] int64
    split: RecurrentSplit | None = None

    def __post_init__(self):
        if self.split is None:
            self.split = RecurrentSplit.of_cu_seqlens(self.cu_seqlens)
