"""One step's plan as the worker's core reads it: plain data, built from the wire message at the gRPC edge
(worker_svc/server.py), so the batch, the runner and their tests never see protobuf.

Requests are addressed by slot (row `slot` of the persistent batch). The cached entries stay packed arrays, as the
scheduler sends them; the batch checks their lengths against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.sampling_fields import SamplingParams


def _no_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class JoiningRequest:
    """A request the worker does not hold: new (its prompt) or resumed (prompt + output so far, to recompute)."""

    slot: int
    request_id: str  # for errors and logs
    token_ids: np.ndarray  # int64: the prompt, or prompt + output of a resumed request
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0  # > 0 when a cached prefix is already in its blocks
    num_scheduled_tokens: int = 0
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    lora_path: str = ""  # its PEFT directory
    # Hybrid models: the recurrent-state slot it holds while in the batch (worker_svc/state_cache.py); -1: none
    # (a model without recurrent layers). Zeroed before the step when num_computed_tokens == 0.
    state_slot: int = -1


@dataclass
class CachedRequests:
    """The requests the worker already holds, only what changed: entry i is slot slots[i], computing
    num_scheduled_tokens[i] tokens and appending the next num_new_blocks[i] of new_block_ids to its table."""

    slots: np.ndarray = field(default_factory=_no_ids)
    num_scheduled_tokens: np.ndarray = field(default_factory=_no_ids)
    num_new_blocks: np.ndarray = field(default_factory=_no_ids)  # empty: no entry has new blocks
    new_block_ids: np.ndarray = field(default_factory=_no_ids)
    num_draft_slots: np.ndarray = field(default_factory=_no_ids)  # speculative decoding; empty: none


@dataclass
class StepPlan:
    step_id: int
    fencing_token: int = 0
    expected_epoch: str = ""  # empty: not checked
    reset_batch: bool = False  # forget every request first
    dropped_slots: np.ndarray = field(default_factory=_no_ids)  # freed before the step (free ones are ignored)
    new_requests: list[JoiningRequest] = field(default_factory=list)
    resumed_requests: list[JoiningRequest] = field(default_factory=list)
    cached: CachedRequests = field(default_factory=CachedRequests)
    replaced_tables: list[tuple[int, list[int]]] = field(default_factory=list)  # (cached slot, whole new table)
    copy_src: np.ndarray = field(default_factory=_no_ids)  # copy-on-write: block copy_src[i] -> copy_dst[i]
    copy_dst: np.ndarray = field(default_factory=_no_ids)
    # Hybrid models: whole state slots copied before the forward (a snapshot restored into a request's slot: a
    # prefix-cache hit, an n > 1 fork), then after it (state_save: a snapshot of src's state after this step).
    state_copy_src: np.ndarray = field(default_factory=_no_ids)
    state_copy_dst: np.ndarray = field(default_factory=_no_ids)
    state_save_src: np.ndarray = field(default_factory=_no_ids)
    state_save_dst: np.ndarray = field(default_factory=_no_ids)
    prompt_lookup_min: int = 0  # n-gram drafts: the suffix lengths tried (read when some entry has draft slots)
    prompt_lookup_max: int = 0
