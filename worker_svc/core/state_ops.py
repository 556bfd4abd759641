"""A step's whole-slot operations on the recurrent-state pool (hybrid models; worker_svc/core/state_cache.py), as
host arrays: the snapshot copies and the zeroing of fresh sequences before the forward, the snapshot saves after
it. Rank 0 takes them from the plan and sends them packed with the step's inputs, so that every tensor-parallel
rank applies them to its own shard of the pool (worker_svc/parallel/rank_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.core.plan import StepPlan
from worker_svc.core.state_cache import StateCache

_FIELDS = ("copy_src", "copy_dst", "fresh", "save_src", "save_dst")


@dataclass
class StateOps:
    copy_src: np.ndarray  # int64: slot copies before the forward (a snapshot into a joining request's slot)
    copy_dst: np.ndarray
    fresh: np.ndarray  # slots zeroed before the forward (requests starting from no computed tokens)
    save_src: np.ndarray  # slot copies after the forward (snapshots of the state after this step)
    save_dst: np.ndarray

    @staticmethod
    def of_plan(plan: StepPlan) -> StateOps:
        fresh = [r.state_slot for r in (*plan.new_requests, *plan.resumed_requests) if r.num_computed_tokens == 0]
        return StateOps(*(np.asarray(a, dtype=np.int64) for a in (
            plan.state_copy_src, plan.state_copy_dst, fresh, plan.state_save_src, plan.state_save_dst)))

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
            return StateOps(*(np.zeros(0, dtype=np.int64) for _ in _FIELDS))
        counts = a[:len(_FIELDS)]
        return StateOps(*np.split(a[len(_FIELDS):], np.cumsum(counts)[:-1]))

    def restore(self, cache: StateCache, device: torch.device) -> None:
        """Before the forward: snapshots copied into slots, then every fresh sequence's slot zeroed."""
        cache.copy(_dev(self.copy_src, device), _dev(self.copy_dst, device))
        cache.zero(_dev(self.fresh, device))

    def save(self, cache: StateCache, device: torch.device) -> None:
        """After the forward: snapshots of the state after this step's tokens (the scheduler's prefix cache)."""
        cache.copy(_dev(self.save_src, device), _dev(self.save_dst, device))


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
