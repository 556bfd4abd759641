"""Per-request sampling parameters, as the worker holds them: the scheduler's record (common/sampling_fields.py),
converted once from the worker's wire message."""

from __future__ import annotations

from common.sampling_fields import SamplingParams
from common.sampling_wire import record_from_wire, record_to_wire
from protos import worker_pb2 as pb

__all__ = ["SamplingParams", "from_proto", "to_proto"]


def from_proto(p: pb.SamplingParams) -> SamplingParams:
    """The wire's values; top_p and repetition_penalty 0 read as 1 (unset); an unset seed is drawn once."""
    return record_from_wire(p)


def to_proto(s: SamplingParams) -> pb.SamplingParams:
    return record_to_wire(s, pb.SamplingParams())
