"""--pooler-config (vLLM's flag and JSON names): how an embedding pools the final hidden states. Plain data, no
torch: the worker's settings check it at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass

LAST, MEAN, CLS = "LAST", "MEAN", "CLS"
POOLING_TYPES = (LAST, MEAN, CLS)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = LAST
    normalize: bool = True

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """--pooler-config's JSON ('' or None: the defaults); ValueError naming the flag and the bad key."""
        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--pooler-config must be a JSON object: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {text!r}")
        unknown = sorted(set(d) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unknown keys {unknown}; known: pooling_type, normalize")
        kind = str(d.get("pooling_type", LAST)).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{d['pooling_type']!r}")
        normalize = d.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"--pooler-config normalize must be true or false, got {normalize!r}")
        return cls(kind, normalize)
