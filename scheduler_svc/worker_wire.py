"""The scheduler's records on the worker's wire format (protos/worker.proto)."""

from __future__ import annotations

from protos import worker_pb2 as wpb
from scheduler_svc.sampling import SamplingParams


def sampling_to_wire(s: SamplingParams) -> wpb.SamplingParams:
    """Every field explicitly; the proto's optional seed and logprobs only when set (unset: the worker draws a seed,
    returns no logprobs)."""
    msg = wpb.SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
        max_tokens=s.max_tokens, stop_token_ids=s.stop_token_ids,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.constraint is not None:
        msg.constraint.kind, msg.constraint.spec = s.constraint["kind"], s.constraint["spec"]
    return msg
