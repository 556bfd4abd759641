"""Paged-attention kernels. `reference` is the torch implementation (CPU production path, test oracle);
`triton_attention` the Triton kernels (same interface), imported lazily: `import kernels` needs no triton."""

from __future__ import annotations

import importlib
from types import ModuleType

from kernels.reference import (
    AttentionMetadata,
    ReferencePlan,
    attention_metadata_from_arrays,
    build_attention_metadata,
    build_reference_plan,
    paged_attention,
    write_kv_cache,
)

BACKENDS = ("torch", "triton")


def get_backend(name: str) -> ModuleType:
    """The module with `write_kv_cache` / `paged_attention` for a backend name: torch or triton.

    Importing the triton backend needs the `triton` package (and a GPU, or TRITON_INTERPRET=1 set
    before the first import to run its kernels on CPU tensors).
    """
    if name == "torch":
        return importlib.import_module("kernels.reference")
    if name == "triton":
        return importlib.import_module("kernels.triton_attention")
    raise ValueError(f"unknown attention backend {name!r}: expected one of {', '.join(BACKENDS)}")


def __getattr__(name: str) -> ModuleType:
    # `kernels.triton_attention` without importing triton at `import kernels` time
    if name == "triton_attention":
        return importlib.import_module("kernels.triton_attention")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "ReferencePlan",
    "attention_metadata_from_arrays",
    "build_attention_metadata",
    "build_reference_plan",
    "get_backend",
    "paged_attention",
    "write_kv_cache",
]
