"""n-gram speculation on a hybrid model: no rejected draft may leave its token in the recurrent state.

A step that verifies drafts runs each speculating sequence's chunk and its drafts through every layer, so its state
slot ends the forward past all of them. The attention layers need no repair (a rejected position's KV is simply
overwritten later), the recurrent state does. Before the forward the state of every speculating slot is kept aside
(StateCache.hold: one slot's bytes per speculating sequence, for the step); after verification, a sequence whose
drafts were not all accepted gets that state back and recomputes its chunk plus the accepted drafts, so its slot
holds the state after its last accepted token, as a step without speculation would leave it. The bonus token is the
next step's input, as always. A step whose drafts were all accepted costs nothing more; each rejection costs a
forward over the accepted rows of the sequences concerned (one, batched for all of them).
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.core.state_ops import StateOps
from worker_svc.core.step_inputs import ModelInputs, build_model_inputs
from worker_svc.core.step_output import StepOutput
from worker_svc.model.layers.recurrent_split import RecurrentSplit
from worker_svc.model.lora import LoraPool


def held_slots(sched: Schedule, num_drafts: np.ndarray | None) -> np.ndarray:
    """The state slots of the chunks that verify drafts in this step (their state is kept aside)."""
    if num_drafts is None:
        return np.zeros(0, dtype=np.int64)
    return sched.inputs.state_slot[sched.rows[num_drafts > 0]].astype(np.int64)


def rejected_chunks(sched: Schedule, out: StepOutput) -> Schedule | None:
    """The chunks to recompute after verification: each live row whose drafts were not all accepted, from its
    chunk's start through its accepted drafts; None when there is none."""
    if not len(out.spec_slots):
        return None
    short = (out.spec_num_accepted_tokens < out.spec_num_draft_tokens) & sched.inputs.live[out.spec_slots]
    rows = out.spec_slots[short]
    if not len(rows):
        return None
    at = {int(r): i for i, r in enumerate(sched.rows)}
    idx = np.array([at[int(r)] for r in rows], dtype=np.int64)
    return Schedule(sched.inputs, rows, sched.starts[idx], sched.lengths[idx] + out.spec_num_accepted_tokens[short])


NO_COPIES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # the step's KV copies are done already


def recompute(redo: Schedule, cache: StateCache, lora: LoraPool | None, block_size: int, device: torch.device,
              build_plan: bool) -> tuple[ModelInputs, StateOps]:
    """Roll `redo`'s slots back to the state kept aside; the inputs that run their accepted rows again (logits
    unused) and the roll-back for the other ranks of a tensor-parallel group (ModelRunner._run sends it, with the
    adapters of these rows: the step's token layout changed)."""
    if lora is not None:
        lora.begin_step(redo.rows, redo.lengths)
    inputs = build_model_inputs(redo, block_size, device, build_plan=build_plan)
    n = len(inputs.input_ids)
    inputs.logits_indices = torch.tensor([n - 1], device=device)  # a head over one row: nothing is sampled
    slots = redo.inputs.state_slot[redo.rows].astype(np.int64)
    inputs.state = StateStep(cache, torch.from_numpy(slots).to(device),
                             inputs.attn_metadata.cu_seqlens_q.to(torch.int64),
                             RecurrentSplit.of_lengths(redo.lengths, device))
    ops = StateOps.none()
    ops.roll_back = slots
    ops.restore(cache, device)
    return inputs, ops
