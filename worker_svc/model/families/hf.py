"""Reading a Hugging Face config.json into ModelConfig fields, refusing every option the model would ignore.

Each refusal names the config.json field, so a checkpoint whose output would silently differ from transformers'
never starts."""

from __future__ import annotations

from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")  # what worker_svc.model.rope_inv_freq implements for every family
# YaRN (rope_inv_freq and its cos/sin scale, rope_tables) is read only by the families that list it (gpt-oss): the
# fused C++ layer loop and the hybrid families' partial rope have not been checked against it.


def require(cfg: dict, field: str, allowed: tuple, default: Any = None) -> Any:
    """cfg[field] (or `default`), which must be one of `allowed`."""
    value = cfg.get(field, default)
    if value not in allowed:
        names = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"config.json field {field}={value!r} is not supported for "
                         f"{'/'.join(cfg.get('architectures') or ['this architecture'])}; supported: {names}")
    return value


def rope(params: dict | None, field: str, default_theta: float = 10000.0,
         rope_types: tuple[str, ...] = ROPE_TYPES) -> tuple[float, dict | None]:
    """(theta, scaling) from one rope dict (5.x's `rope_parameters`, or 4.x's `rope_scaling` with the theta
    given as default); scaling None for plain rope. Refuses a rope type outside `rope_types` (the family's)."""
    scaling = dict(params or {})
    theta = float(scaling.pop("rope_theta", default_theta))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in rope_types:
        raise ValueError(f"config.json field {field}.rope_type={rope_type!r} is not supported; "
                         f"supported: {', '.join(rope_types)}")
    return theta, (None if rope_type == "default" else {"rope_type": rope_type, **scaling})


def hf_rope(cfg: dict, rope_types: tuple[str, ...] = ROPE_TYPES) -> tuple[float, dict | None]:
    """rope theta and scaling from either the 4.x keys (`rope_theta`, `rope_scaling`) or 5.x's `rope_parameters`;
    `rope_types`: what the family's rope implements."""
    if cfg.get("rope_parameters"):
        return rope(cfg["rope_parameters"], "rope_parameters", cfg.get("rope_theta", 10000.0), rope_types)
    return rope(cfg.get("rope_scaling"), "rope_scaling", cfg.get("rope_theta", 10000.0), rope_types)


def windowed_layer_types(cfg: dict, sliding_window: int | None, first_sliding: int = 0) -> list[str] | None:
    """config.json's `layer_types`, else sliding layers from `first_sliding` on when there is a window."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        if sliding_window is None:
            return None
        types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(n)]
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad or len(types) != n:
        raise ValueError(f"config.json field layer_types must list sliding_attention or full_attention for each "
                         f"of the {n} layers (num_hidden_layers); got {types!r}")
    return list(types)
