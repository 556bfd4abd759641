"""Sampling fields between protobuf messages and records, by the names in common/sampling_fields.py.

Works on any message through its descriptor (llmserve.v1, the worker's and vLLM's SamplingParams), so a new row
needs no code here: a scalar, a repeated scalar, a map, a repeated message of one repeated field (a token sequence)
or a message of scalars (the constraint) are read and written alike.
"""

from __future__ import annotations

import secrets
from typing import Any

from common.sampling_fields import FIELDS, SamplingField, SamplingParams


def read(msg: Any, f: SamplingField, name: str) -> Any:
    """Field `name` of `msg` as plain data for row `f`, or None where the message leaves it unset: an optional
    field not set, an empty container, or a proto3 zero that the row's limit does not allow (top_p 0 = unset)."""
    fd = msg.DESCRIPTOR.fields_by_name[name]
    value = getattr(msg, name)
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return dict(value) or None
    if fd.is_repeated:
        if fd.message_type is not None:
            inner = fd.message_type.fields[0].name
            return [list(getattr(v, inner)) for v in value] or None
        return list(value) or None
    if fd.message_type is not None:  # a flag left off stays out, as in records written before it existed
        return {s.name: getattr(value, s.name) for s in fd.message_type.fields
                if s.type != s.TYPE_BOOL or getattr(value, s.name)} if msg.HasField(name) else None
    if fd.has_presence:
        return value if msg.HasField(name) else None
    if not value and f.limit is not None and not f.limit.ok(value):
        return None
    return value


def write(msg: Any, name: str, value: Any) -> None:
    """Set field `name` of `msg` to `value` (plain data, as `read` returns it)."""
    fd = msg.DESCRIPTOR.fields_by_name[name]
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        getattr(msg, name).update(value)
    elif fd.is_repeated and fd.message_type is not None:
        inner = fd.message_type.fields[0].name
        for seq in value:
            getattr(getattr(msg, name).add(), inner).extend(seq)
    elif fd.is_repeated:
        getattr(msg, name).extend(value)
    elif fd.message_type is not None:
        sub = getattr(msg, name)
        for k, v in value.items():
            setattr(sub, k, v)
    else:
        setattr(msg, name, value)


def record_to_wire(s: SamplingParams, msg: Any) -> Any:
    """Every field of the record into `msg` (the worker's SamplingParams); unset ones (None) stay unset."""
    for f in FIELDS:
        value = getattr(s, f.name)
        if value is not None:
            write(msg, f.name, value)
    return msg


def record_from_wire(msg: Any) -> SamplingParams:
    """The record a worker message carries; an unset seed is drawn once here, so a recompute after preemption
    repeats the request's text."""
    kw = {}
    for f in FIELDS:
        value = read(msg, f, f.name)
        if value is not None:
            kw[f.name] = value
    s = SamplingParams(**kw)
    if s.seed is None:
        s.seed = secrets.randbits(63)
    return s


def public_fields(body_value: Any, msg: Any) -> None:
    """The OpenAI body's table fields (those it carries as they are) into llmserve.v1's SamplingParams `msg`;
    `body_value(name)` is the body's value or None."""
    for f in FIELDS:
        if f.public is not None and f.openai:
            value = body_value(f.public)
            if value is not None:
                write(msg, f.public, value)


def vllm_to_public(src: Any, dst: Any) -> str | None:
    """vLLM's engine SamplingParams `src` -> llmserve.v1's `dst` for every row vLLM's protocol carries; returns the
    first refusal (a sentence naming vLLM's field), or None."""
    for f in FIELDS:
        name = f.vllm_name
        if name is None:
            continue
        value = read(src, f, name)
        if value is None:
            continue
        problem = f.problem(value)
        if problem is not None:
            return f"sampling_params.{name} {problem}"
        write(dst, f.public, value)
    return None
