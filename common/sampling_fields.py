"""The sampling fields: one row per field, from which every form a request's sampling takes is derived.

A field travels: the OpenAI body (api_svc/protocol.py) -> llmserve.v1 SamplingParams (protos/llmserve.proto) ->
admission's record (SamplingParams below; the ledger keeps it in Redis as JSON, `to_dict`) -> the worker's wire
(protos/worker.proto) -> the worker's input batch and sampler. vLLM's engine protocol (protos/vllm_engine.proto)
maps onto llmserve.v1. The .proto files declare the messages; a row names its proto fields and
common/sampling_wire.py moves values between messages and records by those names.

Adding a field: its row here, its fields in the .proto files (regenerated), its effect in
worker_svc/sampling/sampler.py.
Changing the rows changes the Redis schema: bump scheduler_svc/ledger/store.py's SCHEMA_VERSION.

Plain data: no protobuf, gRPC or numpy here.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

# Kinds of value. A record holds: FLOAT float, INT int, BOOL bool, TOKEN_IDS list[int], LOGIT_BIAS dict[int, float]
# (token id -> bias), TOKEN_SEQS list[list[int]] (the public API carries strings; admission tokenizes them),
# CONSTRAINT {"kind", "spec"[, "disable_any_whitespace"]} (structured output).
FLOAT, INT, BOOL, TOKEN_IDS, LOGIT_BIAS, TOKEN_SEQS, CONSTRAINT = (
    "float", "int", "bool", "token_ids", "logit_bias", "token_seqs", "constraint")
_SAME = "="  # a row's api / vllm name equal to its record name


@dataclass(frozen=True)
class Limit:
    """A closed or open interval (either end may be missing); `text` replaces the derived wording."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    text: str = ""

    def ok(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


@dataclass(frozen=True)
class SamplingField:
    name: str  # the record's and the worker wire's field name
    kind: str
    default: Any  # what an omitted field means (None: unset; a container default is copied)
    limit: Limit | None = None  # the value (scalars) or each value (logit_bias); refusals name the field and this
    max_items: int | None = None  # containers: at most this many entries
    api: str | None = _SAME  # llmserve.v1's field; None: mapped by hand (constraint: a oneof)
    openai: bool = True  # the OpenAI body carries it under `api` as it is (False: api_svc maps it itself)
    vllm: str | None = None  # vLLM engine protocol's field (None: that protocol has none)
    column: str | None = None  # the worker input batch's numpy column for a scalar (its dtype name)
    column_fill: Any = None  # the column's value for an unset (None) field; default: the field's default

    @property
    def public(self) -> str | None:
        return self.name if self.api == _SAME else self.api

    @property
    def vllm_name(self) -> str | None:
        return self.name if self.vllm == _SAME else self.vllm

    def fresh_default(self) -> Any:
        return copy.copy(self.default)

    def problem(self, value: Any) -> str | None:
        """Why `value` is out of range (a sentence without the field name), or None."""
        if self.max_items is not None and self.kind in (TOKEN_IDS, LOGIT_BIAS, TOKEN_SEQS) \
                and len(value) > self.max_items:
            return f"has {len(value)} entries, the limit is {self.max_items}"
        if self.limit is None:
            return None
        if self.kind == LOGIT_BIAS:
            bad = next((v for v in value.values() if not self.limit.ok(v)), None)
            return None if bad is None else f"values must be {self.limit}, got {bad}"
        return None if self.limit.ok(value) else f"must be {self.limit}, got {value}"


MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 64

FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", FLOAT, 1.0, Limit(0), vllm=_SAME, column="float32"),  # 0 = greedy
    SamplingField("top_k", INT, 0, Limit(-1, text="-1 (off), 0 (off) or >= 1"), vllm=_SAME, column="int64"),
    SamplingField("top_p", FLOAT, 1.0, Limit(0, 1, lo_open=True), vllm=_SAME, column="float32"),
    SamplingField("min_p", FLOAT, 0.0, Limit(0, 1), vllm=_SAME, column="float32"),
    SamplingField("repetition_penalty", FLOAT, 1.0, Limit(0, lo_open=True), vllm=_SAME, column="float32"),
    SamplingField("presence_penalty", FLOAT, 0.0, Limit(-2, 2), vllm=_SAME, column="float32"),
    SamplingField("frequency_penalty", FLOAT, 0.0, Limit(-2, 2), vllm=_SAME, column="float32"),
    # None: admission draws one and keeps it, so preemption, worker loss or a restart replays the same text.
    SamplingField("seed", INT, None, Limit(0), vllm=_SAME, column="uint64", column_fill=0),
    SamplingField("ignore_eos", BOOL, False, vllm=_SAME, column="bool"),
    SamplingField("min_tokens", INT, 0, Limit(0), vllm=_SAME, column="int64"),
    # 0 on the worker: until max_model_len. Admission always sets it (unset: the room the model and the pool leave);
    # the OpenAI body maps it itself (completions default to 16; chat's max_completion_tokens wins).
    SamplingField("max_tokens", INT, 0, Limit(1), openai=False, vllm=_SAME, column="int64"),
    SamplingField("stop_token_ids", TOKEN_IDS, [], vllm=_SAME),
    # None: none; n >= 0: the sampled token's logprob and the n top ones (chat's logprobs + top_logprobs map to it).
    SamplingField("logprobs", INT, None, Limit(hi=20), openai=False, vllm=_SAME, column="int64", column_fill=-1),
    SamplingField("constraint", CONSTRAINT, None, api=None),  # common/structured_outputs.py
    # OpenAI semantics: added to the logits before any other processing.
    SamplingField("logit_bias", LOGIT_BIAS, {}, Limit(-100, 100), max_items=MAX_LOGIT_BIAS, vllm=_SAME),
    # vLLM semantics: each word's tokens, with and without a leading space; a sequence's last token is banned
    # where the output ends with the tokens before it.
    SamplingField("bad_words", TOKEN_SEQS, [], max_items=MAX_BAD_WORDS, vllm=_SAME),
    # None: none; k >= 0: every prompt token's logprob (the first has none) and its k top ones, from the prefill
    # forward; such a request never reads the prefix cache (worker_svc/sampling/prompt_logprobs.py).
    SamplingField("prompt_logprobs", INT, None, Limit(0, 20), vllm=_SAME, column="int64", column_fill=-1),
    # An embedding request (the Embed RPC sets it): prefill only, the pooled hidden state comes back
    # (worker_svc/sampling/pooling.py); never reads the prefix cache either.
    SamplingField("embed", BOOL, False, api=None, openai=False, column="bool"),
)
BY_NAME = {f.name: f for f in FIELDS}


def _decode(f: SamplingField, v: Any) -> Any:
    """A JSON value of field `f` back to the record's type."""
    if v is None:
        return None
    if f.kind == FLOAT:
        return float(v)
    if f.kind == INT:
        return int(v)
    if f.kind == BOOL:
        return bool(v)
    if f.kind == TOKEN_IDS:
        return [int(t) for t in v]
    if f.kind == LOGIT_BIAS:
        return {int(t): float(b) for t, b in v.items()}
    if f.kind == TOKEN_SEQS:
        return [[int(t) for t in seq] for seq in v]
    out = {"kind": str(v["kind"]), "spec": str(v["spec"])}
    if v.get("disable_any_whitespace"):  # kept only when set, so older records read back alike
        out["disable_any_whitespace"] = True
    return out


def _to_dict(self: Any) -> dict[str, Any]:
    """JSON-safe (logit_bias keys become strings in JSON; from_dict turns them back)."""
    return dataclasses.asdict(self)


@classmethod  # type: ignore[misc]
def _from_dict(cls: type, d: dict[str, Any]) -> Any:
    """The inverse of to_dict. Unknown keys are an error; a missing key takes the field's default."""
    unknown = sorted(set(d) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown SamplingParams fields {unknown}")
    return cls(**{name: _decode(BY_NAME[name], v) for name, v in d.items()})


def _greedy(self: Any) -> bool:
    return self.temperature <= 0.0 or self.top_k == 1


def _uses_penalties(self: Any) -> bool:
    return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _plain(self: Any) -> bool:
    """Sampling is a bare argmax: greedy, and nothing else changes the logits or asks for more than the token."""
    return (self.greedy and not self.uses_penalties and not self.min_tokens and self.logprobs is None
            and not self.logit_bias and not self.bad_words)


_TYPES = {FLOAT: float, INT: int, BOOL: bool, TOKEN_IDS: list[int], LOGIT_BIAS: dict[int, float],
          TOKEN_SEQS: list[list[int]], CONSTRAINT: dict[str, str | bool]}

# How a sequence samples, as admission decided it: the scheduler's record (kept in Redis) and the worker's copy (from
# its wire). Field names are the worker message's; defaults are the table's.
SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, _TYPES[f.kind] | None if f.default is None else _TYPES[f.kind],
      dataclasses.field(default_factory=f.fresh_default) if isinstance(f.default, (list, dict))
      else dataclasses.field(default=f.default)) for f in FIELDS],
    namespace={"to_dict": _to_dict, "from_dict": _from_dict, "greedy": property(_greedy),
               "uses_penalties": property(_uses_penalties), "plain": property(_plain),
               "__doc__": "One request's sampling: a value per row of common.sampling_fields.FIELDS."},
)
SamplingParams.__module__ = __name__
