"""--pooler-config (vLLM's flag and JSON names): how an embedding pools the final hidden states. Plain data, no
torch: the worker's settings check it at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from common.json_flag import key_error, parse_json_object

LAST, MEAN, CLS = "LAST", "MEAN", "CLS"
POOLING_TYPES = (LAST, MEAN, CLS)
FLAG = "--pooler-config"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = LAST
    normalize: bool = True

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """--pooler-config's JSON ('' or None: the defaults); JsonFlagError naming the flag and the bad key."""
        d = parse_json_object(FLAG, text, {"pooling_type": (str,), "normalize": (bool,)},
                              '{"pooling_type": "MEAN", "normalize": true}')
        if d is None:
            return cls()
        kind = d.get("pooling_type", LAST).upper()
        if kind not in POOLING_TYPES:
            raise key_error(FLAG, "pooling_type", f"one of {', '.join(POOLING_TYPES)}", d["pooling_type"])
        return cls(kind, d.get("normalize", True))
