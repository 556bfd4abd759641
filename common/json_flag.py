"""JSON-valued flags (vLLM's `--speculative-config`, `--pooler-config`, `--structured-outputs-config`, ...): the text
parsed into an object whose keys and value types are checked, with one error form for every such flag.

The form is the settings' own ("--max-num-seqs must be >= 1, got 0"): the flag, then what is wrong:

    --pooler-config must be a JSON object, e.g. {"pooling_type": "MEAN"}; got '[1]'
    --pooler-config has an unknown key 'pooling'; known: normalize, pooling_type
    --pooler-config key 'normalize' must be true or false, got 1
    --speculative-config key 'num_speculative_tokens' is required (an integer >= 1)

Plain data in and out: each flag's own module turns the checked object into its config and raises `key_error` for
what a type cannot say (a range, a choice).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# What each accepted Python type is called in a message (JSON's names where they differ).
_TYPE_WORDS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                                list: "a list", dict: "an object", type(None): "null"}


class JsonFlagError(ValueError):
    """A JSON-valued flag whose value is wrong; `problem` is the message without the flag's name."""

    def __init__(self, flag: str, problem: str):
        super().__init__(f"{flag} {problem}")
        self.flag = flag
        self.problem = problem


def describe(types: tuple[type, ...]) -> str:
    """'an integer', 'a string or null': what a key of these types takes."""
    return " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # JSON true is a Python int too: only a key that takes booleans accepts it
        return bool in types
    if isinstance(value, int) and float in types:  # 2 is a number
        return True
    return isinstance(value, types)


def key_error(flag: str, key: str, expected: str, value: Any) -> JsonFlagError:
    """The error for a key whose value is not what the flag takes: "key 'k' must be <expected>, got <value>"."""
    return JsonFlagError(flag, f"key {key!r} must be {expected}, got {json.dumps(value)}")


def missing_key(flag: str, key: str, expected: str) -> JsonFlagError:
    return JsonFlagError(flag, f"key {key!r} is required ({expected})")


def parse_json_object(flag: str, text: str | None, keys: Mapping[str, tuple[type, ...]],
                      example: str) -> dict[str, Any] | None:
    """The flag's object (None when the flag is unset or blank), every key known and of one of its types; the
    caller fills in defaults and checks ranges. `example` is a valid value, shown when the text is not an object."""
    if text is None or not text.strip():
        return None
    expected = f"must be a JSON object, e.g. {example}; got {text!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonFlagError(flag, f"{expected} (not JSON: {e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise JsonFlagError(flag, expected)
    for key in value:
        if key not in keys:
            raise JsonFlagError(flag, f"has an unknown key {key!r}; known: {', '.join(sorted(keys))}")
    for key, v in value.items():
        if not _is(v, keys[key]):
            raise key_error(flag, key, describe(keys[key]), v)
    return value
