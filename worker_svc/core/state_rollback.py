"""Speculation on a hybrid model: a recurrent layer keeps no per-position history, so the verification forward
leaves each row's state after all of its drafts, rejected ones included.

Before that forward the drafting rows' states are kept (`keep`); after verification a row that rejected some of
its drafts gets its kept state back and runs its accepted tokens again (`replay`: one more forward over those rows
only, no logits; the KV it rewrites holds the same values). The plan's state snapshots are taken after that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.core.input_batch import InputBatch
from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.core.step_inputs import ModelInputs, build_model_inputs


@dataclass
class KeptStates:
    rows: np.ndarray  # the drafting rows
    starts: np.ndarray
    lengths: np.ndarray
    num_drafts: np.ndarray
    slots: torch.Tensor
    conv: torch.Tensor  # [layers, rows, ...]: the states before the verification forward
    ssm: torch.Tensor


def keep(state: StateCache | None, b: InputBatch, sched: Schedule, num_drafts: np.ndarray | None) -> KeptStates | None:
    if state is None or num_drafts is None or not num_drafts.any():
        return None
    i = np.flatnonzero(num_drafts)
    rows = sched.rows[i]
    slots = torch.from_numpy(b.state_slot[rows].astype(np.int64)).to(state.conv.device)
    return KeptStates(rows, sched.starts[i], sched.lengths[i], num_drafts[i], slots, state.conv[:, slots].clone(),
                      state.ssm[:, slots].clone())


def replay_inputs(kept: KeptStates | None, state: StateCache, b: InputBatch, block_size: int,
                  build_plan: bool) -> ModelInputs | None:
    """After verification: the kept states restored for the rows that rejected drafts, and the forward inputs
    that run their accepted tokens again (None when every draft was accepted or its request finished)."""
    if kept is None:
        return None
    accepted = b.num_computed_tokens[kept.rows] - kept.starts - kept.lengths
    redo = np.flatnonzero(b.live[kept.rows] & (accepted < kept.num_drafts))
    if not len(redo):
        return None
    at = torch.from_numpy(redo).to(kept.slots.device)
    slots = kept.slots[at]
    state.conv[:, slots] = kept.conv[:, at]
    state.ssm[:, slots] = kept.ssm[:, at]
    sched = Schedule(b, kept.rows[redo], kept.starts[redo], kept.lengths[redo] + accepted[redo])
    inputs = build_model_inputs(sched, block_size, state.conv.device, build_plan=build_plan)
    inputs.state = StateStep(state, slots, inputs.attn_metadata.cu_seqlens_q.to(torch.int64))
    return inputs
