"""Per-request sampling parameters, as the worker holds them (converted once from the proto)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from common.structured_outputs import Constraint
from protos import worker_pb2 as pb


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int = 0  # 0: until the model's max length
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: int | None = None  # None: no logprobs; N: the sampled one plus the top N
    constraint: Constraint | None = None  # structured output

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @staticmethod
    def from_proto(p: pb.SamplingParams) -> SamplingParams:
        return SamplingParams(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p if p.top_p > 0 else 1.0,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            # An unseeded request gets a seed once, so its recompute after preemption repeats itself.
            seed=p.seed if p.HasField("seed") else secrets.randbits(63),
            ignore_eos=p.ignore_eos,
            min_tokens=p.min_tokens,
            max_tokens=p.max_tokens,
            stop_token_ids=frozenset(p.stop_token_ids),
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            constraint=Constraint(p.constraint.kind, p.constraint.spec) if p.HasField("constraint") else None,
        )

    def to_proto(self) -> pb.SamplingParams:
        p = pb.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, max_tokens=self.max_tokens, stop_token_ids=sorted(self.stop_token_ids),
        )
        if self.logprobs is not None:
            p.logprobs = self.logprobs
        if self.constraint is not None:
            p.constraint.kind, p.constraint.spec = self.constraint.kind, self.constraint.spec
        return p
