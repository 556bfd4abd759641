"""What one step returns, as plain arrays: one entry per token produced, in plan order (a request's tokens
together), plus its logprobs, speculation counts and phase timings. The gRPC edge packs it into a StepResult
field by field; the finish codes are the wire's FinishReason values (a unit test holds them equal)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FINISH_NONE = 0  # still running
FINISH_EOS = 1
FINISH_STOP_TOKEN = 2  # a stop token id, or a completed structured-output grammar
FINISH_MAX_TOKENS = 3  # max_tokens or max_model_len


def _ints() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _floats() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass
class Logprobs:
    """For the entries whose request asked: the entry's index, the sampled token's logprob and its top
    alternatives, flattened (num_top[j] of them for the j-th such entry)."""

    indices: np.ndarray = field(default_factory=_ints)
    logprobs: np.ndarray = field(default_factory=_floats)
    num_top: np.ndarray = field(default_factory=_ints)
    top_token_ids: np.ndarray = field(default_factory=_ints)
    top_logprobs: np.ndarray = field(default_factory=_floats)


@dataclass
class PromptLogprobs:
    """What a step returns (the wire's prompt_lp_* fields): per entry its slot, the position of its first token
    scored, how many, and how many top ones each; per token scored its logprob and top (id, logprob) pairs,
    flattened."""

    slots: np.ndarray = field(default_factory=_ints)
    starts: np.ndarray = field(default_factory=_ints)
    counts: np.ndarray = field(default_factory=_ints)
    num_top: np.ndarray = field(default_factory=_ints)
    values: np.ndarray = field(default_factory=_floats)
    top_token_ids: np.ndarray = field(default_factory=_ints)
    top_values: np.ndarray = field(default_factory=_floats)

@dataclass
class Pooled:
    """Embed requests whose prompt completed: their slots and pooled vectors (one row each)."""

    slots: np.ndarray = field(default_factory=_ints)
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))

@dataclass
class StepOutput:
    step_id: int
    previous_step_id: int  # the last step executed before this one
    num_scheduled_tokens: int = 0
    slots: np.ndarray = field(default_factory=_ints)  # per entry: the request's slot
    token_ids: np.ndarray = field(default_factory=_ints)
    finish_reasons: np.ndarray = field(default_factory=_ints)  # per entry, FINISH_*
    logprobs: Logprobs = field(default_factory=Logprobs)
    # Speculative decoding, per request that verified drafts: its slot, its drafts, how many were accepted.
    spec_slots: np.ndarray = field(default_factory=_ints)
    spec_num_draft_tokens: np.ndarray = field(default_factory=_ints)
    spec_num_accepted_tokens: np.ndarray = field(default_factory=_ints)
    num_constrained: int = 0  # sampled rows masked by a grammar
    prompt_logprobs: PromptLogprobs | None = None  # requests with prompt_logprobs whose chunk scored some
    pooled: Pooled | None = None  # embed requests whose prompt completed
    mask_seconds: float = 0.0
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0

    @property
    def finished_slots(self) -> np.ndarray:
        return self.slots[self.finish_reasons != FINISH_NONE]
