"""LoRA adapter names and the --lora-modules flag, as the scheduler (which registers them) and the worker (which
reads them) both parse it."""

from __future__ import annotations

import json
from collections.abc import Iterable

FLAG = "--lora-modules"


def _json_module(word: str) -> tuple[str, str]:
    """vLLM's JSON form: {"name": ..., "path": ..., "base_model_name": ...} (the base model is the one served)."""
    try:
        obj = json.loads(word)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} word {word!r} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{FLAG} word {word!r} must be a JSON object with \"name\" and \"path\"")
    unknown = set(obj) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"{FLAG} word {word!r} has unknown field(s) {', '.join(sorted(unknown))} (known: name, "
                         "path, base_model_name)")
    name, path = obj.get("name"), obj.get("path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"{FLAG} word {word!r} needs a non-empty string \"name\" and \"path\"")
    return name, path


def parse_lora_modules(words: str | Iterable[str] | None) -> list[tuple[str, str]]:
    """--lora-modules: words that are `name=path` (vLLM's form; a word may also join several with commas) or JSON
    objects `{"name", "path", "base_model_name"}`. A plain string is split on whitespace unless it is one JSON object.
    ValueError naming the flag and the bad word."""
    if words is None:
        return []
    if isinstance(words, str):
        words = [words] if words.lstrip().startswith("{") else words.split()
    out: list[tuple[str, str]] = []
    for word in words:
        word = word.strip()
        if not word:
            continue
        items = [_json_module(word)] if word.startswith("{") else [_pair(item) for item in word.split(",") if item]
        for name, path in items:
            if any(name == n for n, _ in out):
                raise ValueError(f"{FLAG} names {name!r} twice")
            out.append((name, path))
    return out


def _pair(item: str) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{FLAG} word {item!r} must be NAME=PATH or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return name, path
