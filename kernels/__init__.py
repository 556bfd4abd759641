"""Paged-attention kernels. `reference` is the torch implementation (CPU production path, test oracle)."""

from kernels.reference import (
    AttentionMetadata,
    ReferencePlan,
    build_attention_metadata,
    build_reference_plan,
    paged_attention,
    write_kv_cache,
)

__all__ = [
    "AttentionMetadata",
    "ReferencePlan",
    "build_attention_metadata",
    "build_reference_plan",
    "paged_attention",
    "write_kv_cache",
]
