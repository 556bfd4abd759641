"""Admission control: turn a public GenerateRequest into a scheduler Request, or refuse it with a clear error.

Every refusal names the field and the limit. Nothing here touches shared state.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from common.structured_outputs import CHOICE, JSON_OBJECT, Constraint, ConstraintError, check_shape, choice_spec
from common.tokenizer import CHAT_ROLES, Tokenizer
from protos import llmserve_pb2 as pb
from scheduler_svc.request import Request
from scheduler_svc.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_STOP_BYTES = 256


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
    if s.HasField("temperature") and not s.temperature >= 0:
        raise _invalid(f"sampling.temperature must be >= 0, got {s.temperature}")
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        raise _invalid(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < -1:
        raise _invalid(f"sampling.top_k must be -1 (off), 0 (off) or >= 1, got {s.top_k}")
    if s.HasField("min_p") and not 0 <= s.min_p <= 1:
        raise _invalid(f"sampling.min_p must be in [0, 1], got {s.min_p}")
    if s.HasField("repetition_penalty") and not s.repetition_penalty > 0:
        raise _invalid(f"sampling.repetition_penalty must be > 0, got {s.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if s.HasField(name) and not -2 <= getattr(s, name) <= 2:
            raise _invalid(f"sampling.{name} must be in [-2, 2], got {getattr(s, name)}")
    if s.HasField("max_tokens") and s.max_tokens < 1:
        raise _invalid(f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    if s.n > MAX_N:
        raise _invalid(f"sampling.n must be <= {MAX_N}, got {s.n}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"sampling.stop has {len(s.stop)} strings, the limit is {MAX_STOP_STRINGS}")
    for i, stop in enumerate(s.stop):
        n = len(stop.encode())
        if n > MAX_STOP_BYTES:
            raise _invalid(f"sampling.stop[{i}] is {n} bytes long, the limit is {MAX_STOP_BYTES}")
    if s.HasField("logprobs") and s.logprobs > 20:
        raise _invalid(f"sampling.logprobs must be <= 20, got {s.logprobs}")


def constraint_of(s: pb.SamplingParams) -> tuple[str, Constraint] | None:
    """The request's structured-output constraint and its field name, shape-checked (compiling is the worker's:
    server.py asks it before the request is queued); None without one."""
    name = s.WhichOneof("constraint")
    if name is None:
        return None
    try:
        if name == CHOICE:
            c = Constraint(CHOICE, choice_spec(list(s.choice.choices)))
        elif name == JSON_OBJECT:
            c = Constraint(JSON_OBJECT)
        else:
            c = Constraint(name, getattr(s, name))
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
        messages = []
        for i, m in enumerate(req.chat.messages):
            if m.role not in CHAT_ROLES:
                raise _invalid(f"chat.messages[{i}].role {m.role!r} is unknown; allowed: {', '.join(CHAT_ROLES)}")
            messages.append({"role": m.role, "content": m.content})
        if not messages:
            raise _invalid("chat.messages is empty")
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
    else:
        raise _invalid("prompt is missing: set text, token_ids or chat")
    if not ids:
        raise _invalid("prompt is empty (0 tokens)")
    return ids


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


def build_requests(req: pb.GenerateRequest, ids: list[int], limits: Limits, request_id: str) -> list[Request]:
    """One Request per sequence (n > 1: sequence i samples with seed + i and forks from sequence 0)."""
    first = build_request(req, ids, limits, request_id)
    n = max(1, req.sampling.n)
    if n == 1:
        return [first]
    seqs = []
    for i, rid in enumerate(sequence_ids(request_id, n)):
        sampling = replace(first.sampling, seed=(first.sampling.seed + i) % (1 << 63),
                           stop_token_ids=list(first.sampling.stop_token_ids))
        seq = replace(first, request_id=rid, sampling=sampling, stop=list(first.stop),
                      output_ids=[], block_ids=[], fork_of=request_id + "#0" if i else "")
        seqs.append(seq)
    return seqs


def build_request(req: pb.GenerateRequest, ids: list[int], limits: Limits, request_id: str) -> Request:
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
    bad = next((t for t in s.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise _invalid(f"sampling.stop_token_ids contains {bad}, outside the vocabulary [0, {limits.vocab_size})")
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=max(0, s.top_k) if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        # A seed is fixed at admission, so preemption, worker loss or a scheduler restart replays the same text.
        seed=s.seed if s.HasField("seed") else secrets.randbits(63),
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens, max_tokens=max_tokens,
        stop_token_ids=list(s.stop_token_ids),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )
    structured = constraint_of(s)
    if structured is not None:
        sampling.constraint = {"kind": structured[1].kind, "spec": structured[1].spec}
    return Request(
        request_id=request_id, prompt_ids=ids, sampling=sampling, priority=req.priority, arrival_time=time.time(),
        stop=list(s.stop), include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        cache_salt=req.cache_salt,
    )
