"""Structured outputs: the canonical form of a constraint, its xgrammar grammar, and `--structured-outputs-config`.

Shared by the scheduler (admission checks the shape of a constraint) and the worker (which compiles it against the
model's vocabulary and masks logits with it). A constraint is (kind, spec) with spec a string, so equal constraints
are equal keys of the worker's grammar cache and the request record in Redis stays plain JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from common.json_flag import key_error, parse_json_object

JSON_SCHEMA, REGEX, GRAMMAR, JSON_OBJECT, CHOICE = "json_schema", "regex", "grammar", "json_object", "choice"
KINDS = (JSON_SCHEMA, REGEX, GRAMMAR, JSON_OBJECT, CHOICE)
BACKENDS = ("auto", "xgrammar")  # vLLM's values that mean xgrammar here
MAX_SPEC_BYTES = 1 << 20
FLAG = "--structured-outputs-config"


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message says why (without xgrammar's source locations)."""


@dataclass(frozen=True)
class Constraint:
    kind: str
    spec: str = ""
    # json_schema: no optional whitespace, whatever the server's config says (forced tool calls, vLLM's per-request
    # structured_outputs.disable_any_whitespace); a different key of the worker's grammar cache.
    disable_any_whitespace: bool = False

    def describe(self) -> str:
        return f"{self.kind} ({len(self.spec)} bytes)"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config` keys that apply here."""

    backend: str = "auto"
    disable_any_whitespace: bool = False  # True: JSON without optional whitespace (shorter outputs)

    @staticmethod
    def parse(text: str | None) -> StructuredOutputsConfig:
        """From the flag's JSON (None or "": the defaults); JsonFlagError naming the flag and the key when wrong."""
        d = parse_json_object(FLAG, text, {"backend": (str,), "disable_any_whitespace": (bool,)},
                              '{"backend": "xgrammar"}')
        if d is None:
            return StructuredOutputsConfig()
        backend = d.get("backend", "auto")
        if backend not in BACKENDS:
            raise key_error(FLAG, "backend", f"one of {', '.join(BACKENDS)} (auto = xgrammar)", backend)
        return StructuredOutputsConfig(backend=backend, disable_any_whitespace=d.get("disable_any_whitespace", False))


def choice_spec(choices: list[str]) -> str:
    if not choices:
        raise ConstraintError("the choice list is empty; give at least one string")
    return json.dumps(list(choices))


def check_shape(c: Constraint) -> None:
    """What can be checked without compiling: the kind, the size, and that JSON specs are JSON of the right type."""
    if c.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}")
    if len(c.spec.encode()) > MAX_SPEC_BYTES:
        raise ConstraintError(f"is {len(c.spec.encode())} bytes long, the limit is {MAX_SPEC_BYTES}")
    if c.kind == JSON_SCHEMA:
        try:
            schema = json.loads(c.spec)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"must be a JSON object (a schema), got {type(schema).__name__}")
    elif c.kind == CHOICE:
        choices = json.loads(c.spec)
        if not choices:
            raise ConstraintError("the choice list is empty; give at least one string")
        if not all(isinstance(x, str) for x in choices):
            raise ConstraintError("every choice must be a string")
    elif c.kind in (REGEX, GRAMMAR) and not c.spec:
        raise ConstraintError("is empty")


_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(e: Exception) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(e).strip()).strip()


def _ebnf_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string literal is an EBNF string literal for xgrammar


def build_grammar(c: Constraint, cfg: StructuredOutputsConfig):
    """The xgrammar Grammar of a constraint (not yet compiled against a vocabulary), or ConstraintError."""
    import xgrammar as xgr

    check_shape(c)
    try:
        if c.kind == JSON_SCHEMA:
            compact = c.disable_any_whitespace or cfg.disable_any_whitespace
            return xgr.Grammar.from_json_schema(c.spec, any_whitespace=not compact)
        if c.kind == JSON_OBJECT:
            return xgr.Grammar.builtin_json_grammar()
        if c.kind == REGEX:
            return xgr.Grammar.from_regex(c.spec)
        if c.kind == CHOICE:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(x) for x in json.loads(c.spec)))
        return xgr.Grammar.from_ebnf(c.spec)
    except (RuntimeError, ValueError) as e:
        raise ConstraintError(_clean(e)) from None
