"""--speculative-config: n-gram (prompt lookup) speculative decoding, parsed and checked at start-up.

The scheduler owns the setting: it grants each decoding request up to `num_speculative_tokens` draft positions per
step (token budget and KV blocks) and sends the lookup lengths in the plan. The worker proposes the drafts itself,
right before the forward, from the request's tokens it already holds (worker_svc/core/ngram_drafts.py): with pipelined
scheduling the scheduler plans step k + 1 before step k's tokens are known, so drafts it proposed would always be
one step stale. The drafts are a pure function of the request's tokens, so a recompute reproduces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

FLAG = "--speculative-config"
METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # draft positions per request and step; more only adds rows the model rejects
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    method: str = "ngram"


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The flag's JSON (vLLM's keys) as a config, None when unset; ValueError naming the flag and the key."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} must be a JSON object, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": "
                         f"4, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}}': {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    method = raw.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"{FLAG}: method {method!r} is not supported (supported: {', '.join(METHODS)}: n-gram "
                         "prompt lookup)")
    if "num_speculative_tokens" not in raw:
        raise ValueError(f"{FLAG}: num_speculative_tokens is required")
    values = {}
    for key, default in (("num_speculative_tokens", None), ("prompt_lookup_min", 1), ("prompt_lookup_max", None)):
        v = raw.get(key, default)
        if v is None:  # prompt_lookup_max: 4, or prompt_lookup_min when that is larger
            v = max(4, values.get("prompt_lookup_min", 1))
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{FLAG}: {key} must be an integer, got {v!r}")
        if v < 1:
            raise ValueError(f"{FLAG}: {key} must be >= 1, got {v}")
        values[key] = v
    if values["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{FLAG}: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got "
                         f"{values['num_speculative_tokens']}")
    if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
        raise ValueError(f"{FLAG}: prompt_lookup_min ({values['prompt_lookup_min']}) must be <= prompt_lookup_max "
                         f"({values['prompt_lookup_max']})")
    return SpeculativeConfig(method=method, **values)
