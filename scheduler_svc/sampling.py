"""The scheduler's own record of how a sequence samples, as decided at admission.

Plain data, independent of the worker's wire format (`protos/worker.proto` SamplingParams, built from this by
`scheduler_svc.worker_wire.sampling_to_wire`) and of the client's request. The field names are the worker
message's, so `req.sampling.max_tokens`, `.temperature`, `.top_p`, `.seed` read the same as before. This is also
what the ledger stores in Redis (`to_dict()` as JSON), under the store's SCHEMA_VERSION: changing a field's name or
meaning here changes the Redis schema, and must bump that version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """Defaults are what admission fills in for a field the client left unset (except seed and max_tokens, which
    admission always sets: a drawn seed, and the room left in the model and the KV pool)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the worker draws one (admission always fixes one, so replays match)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int = 0  # admission always sets it (> 0)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: not requested; n >= 0: the sampled token's logprob and the n top ones
    # Structured output (common/structured_outputs.py), the wire message's fields: {"kind": json_schema | regex |
    # grammar | json_object | choice, "spec": its text (a choice list as JSON)}; None = unconstrained.
    constraint: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: floats, ints, bools, None, a list of ints and a dict of two strings."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """The inverse of to_dict. Unknown keys are an error; a missing key takes the field's default."""
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown SamplingParams fields {unknown}")
        kw: dict[str, Any] = {}
        for name, value in d.items():
            conv = _CONVERT[name]
            if name == "stop_token_ids":
                kw[name] = [int(t) for t in value]
            elif value is None and name in _OPTIONAL:
                kw[name] = None
            else:
                kw[name] = conv(value)
        return cls(**kw)


_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_OPTIONAL = {"seed", "logprobs", "constraint"}
_CONVERT: dict[str, Any] = {
    "temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "seed": int, "ignore_eos": bool, "min_tokens": int,
    "max_tokens": int, "stop_token_ids": list, "logprobs": int,
    "constraint": lambda d: {"kind": str(d["kind"]), "spec": str(d["spec"])},
}
assert set(_CONVERT) == _FIELDS
