"""--speculative-config: speculative decoding (n-gram, a draft model, EAGLE-3, MTP), parsed and checked at start-up.

The scheduler owns the setting: it grants each decoding request up to `num_speculative_tokens` draft positions per
step (token budget and KV blocks) and sends the lookup lengths in the plan. The worker proposes the drafts itself,
right before the forward, from the request's tokens it already holds (worker_svc/core/ngram_drafts.py): with pipelined
scheduling the scheduler plans step k + 1 before step k's tokens are known, so drafts it proposed would always be
one step stale. The drafts are a pure function of the request's tokens, so a recompute reproduces them.

`draft_model` names a smaller model of the same tokenizer (`model`, a directory or GGUF file): the worker loads it
beside the target and runs it inside its step (worker_svc/core/draft_model.py); the scheduler grants draft positions
the same way for every method. `eagle3` (an EAGLE-3 head at `model`) and `mtp` (the target checkpoint's own MTP
layers) draft from the target's hidden states on the worker (worker_svc/core/hidden_drafts.py). Both processes read
the flag (`llmserve serve` passes it to each); the worker's proposer dispatch is worker_svc/core/speculation.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import setting
from common.json_flag import JsonFlagError, key_error, missing_key, parse_json_object

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model", "eagle3", "mtp")
HEAD_METHODS = ("eagle3", "mtp")  # drafts from the target's hidden states
MAX_SPECULATIVE_TOKENS = 16  # draft positions per request and step; more only adds rows the model rejects
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_DESCRIBED = {"ngram": "n-gram prompt lookup", "draft_model": "a smaller model with the same tokenizer, `model`",
              "eagle3": "an EAGLE-3 head, `model`", "mtp": "the target checkpoint's MTP layers"}


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    method: str = "ngram"
    model: str | None = None  # draft_model: the draft's checkpoint; eagle3: the head's directory; mtp: None


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
        raise key_error(FLAG, "method", "one of " + ", ".join(f"{m} ({d})" for m, d in _DESCRIBED.items()), method)
    model = raw.get("model")
    if method == "draft_model" and not model:
        raise missing_key(FLAG, "model", "the draft model's directory or GGUF file (same tokenizer as --model)")
    if method == "eagle3" and not model:
        raise missing_key(FLAG, "model", "the EAGLE-3 head's directory (config.json + safetensors) for method eagle3")
    if method in ("ngram", "mtp") and model is not None:
        raise key_error(FLAG, "model", f"absent for method {method} (it drafts without a separate model)", model)
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


def _problem(text: str | None) -> str | None:
    try:
        parse_speculative_config(text)
    except JsonFlagError as e:
        return e.problem
    return None


def speculative_config_setting() -> Any:
    """The flag, shared by the scheduler (grants draft positions) and the worker (loads a draft model or head)."""
    return setting(
        None, "speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}' (n-gram prompt lookup), '{\"method\": "
        "\"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}' (a smaller model with the same tokenizer, "
        "run by the worker), '{\"method\": \"eagle3\", \"model\": DIR, \"num_speculative_tokens\": 3}' (an EAGLE-3 "
        "head) or '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' (the checkpoint's own MTP layers)",
        metavar="JSON", aliases=("-sc",), check=_problem)
