"""--speculative-config: speculative decoding, parsed and checked at start-up by the scheduler and the worker.

The scheduler owns the setting: it grants each decoding request up to `num_speculative_tokens` draft positions per
step (token budget and KV blocks) and sends the lookup lengths in the plan. The worker proposes the drafts itself,
right before the forward, from the request's tokens it already holds (worker_svc/core/ngram_drafts.py): with pipelined
scheduling the scheduler plans step k + 1 before step k's tokens are known, so drafts it proposed would always be
one step stale. The drafts are a pure function of the request's tokens, so a recompute reproduces them.

`eagle3` (an EAGLE-3 head at `model`) and `mtp` (the target checkpoint's own MTP layers) draft from the target's
hidden states on the worker (worker_svc/core/hidden_drafts.py); the worker reads the same flag to load the head, and
the scheduler grants their draft slots exactly as for n-gram.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.json_flag import key_error, missing_key, parse_json_object

FLAG = "--speculative-config"
METHODS = ("ngram", "eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 16  # draft positions per request and step; more only adds rows the model rejects
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
HEAD_METHODS = ("eagle3", "mtp")  # drafts from the target's hidden states


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    method: str = "ngram"
    model: str | None = None  # eagle3: the head's directory; mtp: the target's own (None)


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The flag's JSON (vLLM's keys) as a config, None when unset; JsonFlagError naming the flag and the key."""
    raw = parse_json_object(FLAG, text, {"method": (str,), "model": (str, type(None)),
                                         **dict.fromkeys(_KEYS[1:], (int,))},
                            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                            '"prompt_lookup_max": 4}')
    if raw is None:
        return None
    method = raw.get("method", "ngram")
    if method not in METHODS:
        raise key_error(FLAG, "method", f"one of {', '.join(METHODS)}", method)
    model = raw.get("model")
    if method == "eagle3" and not model:
        raise missing_key(FLAG, "model", "the EAGLE-3 head's directory (config.json + safetensors) for method eagle3")
    if method == "ngram" and model:
        raise key_error(FLAG, "model", "absent for method ngram (prompt lookup needs no draft model)", model)
    if "num_speculative_tokens" not in raw:
        raise missing_key(FLAG, "num_speculative_tokens", f"an integer >= 1 and <= {MAX_SPECULATIVE_TOKENS}")
    n = raw["num_speculative_tokens"]
    if not 1 <= n <= MAX_SPECULATIVE_TOKENS:
        raise key_error(FLAG, "num_speculative_tokens", f"an integer >= 1 and <= {MAX_SPECULATIVE_TOKENS}", n)
    low = raw.get("prompt_lookup_min", 1)
    if low < 1:
        raise key_error(FLAG, "prompt_lookup_min", "an integer >= 1", low)
    high = raw.get("prompt_lookup_max", max(4, low))  # 4, or prompt_lookup_min when that is larger
    if high < low:
        raise key_error(FLAG, "prompt_lookup_max", f"an integer >= prompt_lookup_min ({low})", high)
    return SpeculativeConfig(num_speculative_tokens=n, prompt_lookup_min=low, prompt_lookup_max=high, method=method,
                             model=model)
