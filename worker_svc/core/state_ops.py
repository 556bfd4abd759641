"""A step's whole-slot operations on the recurrent-state pool (hybrid models; worker_svc/core/state_cache.py), as
host arrays: the snapshot copies and the zeroing of fresh sequences before the forward, the snapshot saves after
it. Rank 0 takes them from the plan and sends them packed with the step's inputs, so that every tensor-parallel
rank applies them to its own shard of the pool (worker_svc/parallel/rank_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.core.plan import StepPlan
from worker_svc.core.state_cache import StateCache

_FIELDS = ("copy_src", "copy_dst", "fresh", "save_src", "save_dst", "hold", "roll_back")
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StateOps:
    copy_src: np.ndarray  # int64: slot copies before the forward (a snapshot into a joining request's slot)
    copy_dst: np.ndarray
    fresh: np.ndarray  # slots zeroed before the forward (requests starting from no computed tokens)
    save_src: np.ndarray  # slot copies after the forward (snapshots of the state after this step)
    save_dst: np.ndarray
    # Speculative decoding (worker_svc/core/draft_rollback.py): slots whose state is kept aside before the forward,
    # and slots put back to what was kept (before a recompute of the tokens their verification accepted).
    hold: np.ndarray = field(default_factory=lambda: _EMPTY)
    roll_back: np.ndarray = field(default_factory=lambda: _EMPTY)

    @staticmethod
    def of_plan(plan: StepPlan) -> StateOps:
        fresh = [r.state_slot for r in (*plan.new_requests, *plan.resumed_requests) if r.num_computed_tokens == 0]
        return StateOps(*(np.asarray(a, dtype=np.int64) for a in (
            plan.state_copy_src, plan.state_copy_dst, fresh, plan.state_save_src, plan.state_save_dst)))

    @staticmethod
    def none() -> StateOps:
        """Nothing to do (a model without recurrent layers)."""
        return StateOps(*(_EMPTY for _ in _FIELDS))

    def __bool__(self) -> bool:
        return any(len(getattr(self, f)) for f in _FIELDS)

    def pack(self) -> np.ndarray:
        """[5 counts, then the arrays end to end] (empty when there is nothing to do)."""
        if not self:
            return np.zeros(0, dtype=np.int64)
        parts = [getattr(self, f) for f in _FIELDS]
        return np.concatenate([np.array([len(p) for p in parts], dtype=np.int64), *parts])

    @staticmethod
    def unpack(a: np.ndarray) -> StateOps:
        if not len(a):
            return StateOps.none()
        counts = a[:len(_FIELDS)]
        return StateOps(*np.split(a[len(_FIELDS):], np.cumsum(counts)[:-1]))

    def restore(self, cache: StateCache | None, device: torch.device) -> None:
        """Before the forward: snapshots copied into slots, every fresh sequence's slot zeroed, rejected drafts'
        slots rolled back; then the state of the slots that speculate kept aside."""
        if not self:
            return
        cache.copy(_dev(self.copy_src, device), _dev(self.copy_dst, device))
        cache.zero(_dev(self.fresh, device))
        cache.roll_back(_dev(self.roll_back, device))
        if len(self.hold) or not len(self.roll_back):
            cache.hold(_dev(self.hold, device))

    def save(self, cache: StateCache | None, device: torch.device) -> None:
        """After the forward: snapshots of the state after this step's tokens (the scheduler's prefix cache)."""
        if not len(self.save_src):
            return
        cache.copy(_dev(self.save_src, device), _dev(self.save_dst, device))


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
