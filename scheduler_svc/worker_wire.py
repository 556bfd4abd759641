"""The scheduler's records on the worker's wire format (protos/worker.proto)."""

from __future__ import annotations

from common.sampling_fields import SamplingParams
from common.sampling_wire import record_to_wire
from protos import worker_pb2 as wpb


def sampling_to_wire(s: SamplingParams) -> wpb.SamplingParams:
    """Every field explicitly (by the table's names); the proto's optional seed and logprobs only when set (unset:
    the worker draws a seed, returns no logprobs)."""
    return record_to_wire(s, wpb.SamplingParams())
