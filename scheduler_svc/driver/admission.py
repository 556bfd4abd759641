"""Admission control: turn a public GenerateRequest into a scheduler Request, or refuse it with a clear error.

Every refusal names the field and the limit. Nothing here touches shared state.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import jinja2

from common.chat_messages import template_messages, template_tools
from common.request_limits import MAX_N, MAX_STOP_BYTES, MAX_STOP_STRINGS
from common.sampling_fields import FIELDS, LOGIT_BIAS, TOKEN_IDS, SamplingField, SamplingParams
from common.sampling_wire import read
from common.structured_outputs import (
    CHOICE,
    JSON_OBJECT,
    JSON_SCHEMA,
    Constraint,
    ConstraintError,
    check_shape,
    choice_spec,
)
from common.tokenizer import CHAT_ROLES, Tokenizer
from protos import llmserve_pb2 as pb
from scheduler_svc.core.request import Request


class AdmissionError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(msg: str) -> AdmissionError:
    return AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, msg)


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    kv_pool_tokens: int  # num_blocks * block_size
    block_size: int


def check_sampling(s: pb.SamplingParams) -> None:
    """Every table field against its limit (common/sampling_fields.py), then the request-level fields."""
    for f in FIELDS:
        if f.public is not None:
            value = read(s, f, f.public)
            problem = None if value is None else f.problem(value)
            if problem is not None:
                raise _invalid(f"sampling.{f.public} {problem}")
    if s.n > MAX_N:
        raise _invalid(f"sampling.n must be <= {MAX_N}, got {s.n}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"sampling.stop has {len(s.stop)} strings, the limit is {MAX_STOP_STRINGS}")
    for i, stop in enumerate(s.stop):
        n = len(stop.encode())
        if n > MAX_STOP_BYTES:
            raise _invalid(f"sampling.stop[{i}] is {n} bytes long, the limit is {MAX_STOP_BYTES}")
    for i, word in enumerate(s.bad_words):
        n = len(word.encode())
        if not word.strip() or n > MAX_STOP_BYTES:
            raise _invalid(f"sampling.bad_words[{i}] must be 1 to {MAX_STOP_BYTES} bytes and not only spaces, "
                           f"got {n} bytes")


def constraint_of(s: pb.SamplingParams) -> tuple[str, Constraint] | None:
    """The request's structured-output constraint and its field name, shape-checked (compiling is the worker's:
    the servicer asks it before the request is queued); None without one."""
    name = s.WhichOneof("constraint")
    if name is None:
        return None
    try:
        if name == CHOICE:
            c = Constraint(CHOICE, choice_spec(list(s.choice.choices)))
        elif name == JSON_OBJECT:
            c = Constraint(JSON_OBJECT)
        else:
            c = Constraint(name, getattr(s, name), name == JSON_SCHEMA and s.disable_any_whitespace)
        check_shape(c)
    except ConstraintError as e:
        raise _invalid(f"sampling.{name}: {e}") from None
    return name, c


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        ids = tokenizer.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise _invalid(f"prompt token_ids contains {bad}, outside the vocabulary [0, {limits.vocab_size})")
    elif kind == "chat":
        for i, m in enumerate(req.chat.messages):
            if m.role not in CHAT_ROLES:
                raise _invalid(f"chat.messages[{i}].role {m.role!r} is unknown; allowed: {', '.join(CHAT_ROLES)}")
        if not req.chat.messages:
            raise _invalid("chat.messages is empty")
        try:
            messages, tools = template_messages(req.chat), template_tools(req.chat)
        except ValueError as e:
            raise _invalid(str(e)) from None
        extra = {"tools": tools} if tools is not None else {}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except (ValueError, TypeError, jinja2.TemplateError) as e:  # the model's own template refused the history
            raise _invalid(f"chat.messages: the chat template failed: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        raise _invalid("prompt is missing: set text, token_ids or chat")
    if not ids:
        raise _invalid("prompt is empty (0 tokens)")
    return ids


def _outside_vocab(f: SamplingField, value: object, vocab_size: int) -> int | None:
    """The first token id of a token-id field (stop_token_ids, logit_bias's keys) outside the vocabulary."""
    if f.kind not in (TOKEN_IDS, LOGIT_BIAS):
        return None
    return next((t for t in value if not 0 <= t < vocab_size), None)


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's reading of bad_words: each word's tokens as written after another word (a leading space) and as
    written alone, without duplicates."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (" " + word.lstrip(), word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def sequence_ids(request_id: str, n: int) -> list[str]:
    """Ids of a request's sequences: the request id itself for n = 1, `id#i` for n > 1."""
    return [request_id] if n <= 1 else [f"{request_id}#{i}" for i in range(n)]


def abort_sequences(abort: Callable[[str], bool], request_id: str) -> bool:
    """Abort a request by the id its client sent: that id (n = 1), else each of its sequences `id#i` (submitted
    together, so the first missing index ends them). `abort(sequence id)` says whether it was found."""
    if abort(request_id):
        return True
    found = False
    for rid in sequence_ids(request_id, MAX_N):
        if not abort(rid):
            break
        found = True
    return found


def build_requests(req: pb.GenerateRequest, ids: list[int], limits: Limits, request_id: str,
                   tokenizer: Tokenizer | None = None, lora_path: str = "") -> list[Request]:
    """One Request per sequence (n > 1: sequence i samples with seed + i and forks from sequence 0).
    `tokenizer`: for bad_words (a request with them is refused without one). `lora_path`: the directory of the
    registered adapter req.lora_name."""
    first = build_request(req, ids, limits, request_id, tokenizer)
    first.lora_name, first.lora_path = req.lora_name, lora_path
    n = max(1, req.sampling.n)
    if n == 1:
        return [first]
    seqs = []
    for i, rid in enumerate(sequence_ids(request_id, n)):
        sampling = SamplingParams.from_dict(first.sampling.to_dict())  # a deep copy: nothing shared
        sampling.seed = (first.sampling.seed + i) % (1 << 63)
        seq = replace(first, request_id=rid, sampling=sampling, stop=list(first.stop),
                      output_ids=[], block_ids=[], fork_of=request_id + "#0" if i else "")
        seqs.append(seq)
    return seqs


def build_request(req: pb.GenerateRequest, ids: list[int], limits: Limits, request_id: str,
                  tokenizer: Tokenizer | None = None) -> Request:
    """Check lengths against the model and the KV pool, fill in defaults, return the Request."""
    s = req.sampling
    n = len(ids)
    if n >= limits.max_model_len:
        raise _invalid(f"prompt is {n} tokens; it must be shorter than max_model_len {limits.max_model_len}")
    # Unset max_tokens: as long as the model and the KV pool allow (a pool smaller than max_model_len caps it).
    max_tokens = s.max_tokens if s.HasField("max_tokens") else min(limits.max_model_len, limits.kv_pool_tokens) - n
    if max_tokens < 1:
        raise AdmissionError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"prompt ({n} tokens) leaves no room to generate in the KV pool of "
                             f"{limits.kv_pool_tokens} tokens")
    if n + max_tokens > limits.max_model_len:
        raise _invalid(f"prompt ({n} tokens) + sampling.max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                       f"max_model_len {limits.max_model_len}")
    if n + max_tokens > limits.kv_pool_tokens:
        raise AdmissionError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens can never "
                             f"fit the KV pool of {limits.kv_pool_tokens} tokens, even alone")
    sampling = SamplingParams()
    for f in FIELDS:
        value = read(s, f, f.public) if f.public is not None else None
        if value is None:
            continue
        bad = _outside_vocab(f, value, limits.vocab_size)
        if bad is not None:
            raise _invalid(f"sampling.{f.public} contains token id {bad}, outside the vocabulary "
                           f"[0, {limits.vocab_size})")
        setattr(sampling, f.name, value)
    sampling.top_k = max(0, sampling.top_k)  # -1 and 0 both mean off
    sampling.max_tokens = max_tokens
    # A seed is fixed at admission, so preemption, worker loss or a scheduler restart replays the same text.
    if sampling.seed is None:
        sampling.seed = secrets.randbits(63)
    if s.bad_words:
        if tokenizer is None:
            raise _invalid("sampling.bad_words needs the scheduler's tokenizer")
        sampling.bad_words = bad_words_token_ids(list(s.bad_words), tokenizer)
    structured = constraint_of(s)
    if structured is not None:
        c = structured[1]
        sampling.constraint = {"kind": c.kind, "spec": c.spec}
        if c.disable_any_whitespace:
            sampling.constraint["disable_any_whitespace"] = True
    return Request(
        request_id=request_id, prompt_ids=ids, sampling=sampling, priority=req.priority, arrival_time=time.time(),
        stop=list(s.stop), include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        cache_salt=req.cache_salt,
    )
