"""LoRA adapter names and the --lora-modules flag, as the scheduler (which registers them) and the worker (which
reads them) both parse it."""

from __future__ import annotations


def parse_lora_modules(text: str | None) -> list[tuple[str, str]]:
    """--lora-modules: `name=path` pairs separated by spaces or commas (vLLM's form). ValueError naming the entry."""
    out: list[tuple[str, str]] = []
    for item in (text or "").replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {item!r} must be NAME=PATH")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    return out
