"""glibc's heap while the model loads: every large buffer mapped on its own, so a freed one goes back to the system.

Loading reads, converts and frees one tensor after another (safetensors_stream.py). With glibc's default dynamic
mmap threshold, the first large free raises the threshold to that block's size, after which the next temporaries
of the same size come from the heap; the kept tensors then sit between freed holes that stay in the resident set
(measured: a 0.62 GB FP8 checkpoint kept 1.79 GB against 1.35 GB with the threshold fixed at 64 KiB,
experiments/results/load-memory-2026-12-07-quantized.md). So while loading, the threshold is fixed low; after it,
raised to the ceiling the dynamic rule would reach in the steps (32 MiB, trim threshold twice that), so a step's
activation temporaries keep coming from the heap without a map and unmap each.

Setting: $LLMSERVE_LOAD_MMAP_THRESHOLD (bytes, default 65536; 0 leaves glibc's defaults). A
$MALLOC_MMAP_THRESHOLD_ in the environment is glibc's own setting and wins: nothing is changed then.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator

ENV = "LLMSERVE_LOAD_MMAP_THRESHOLD"
DEFAULT_LOAD_THRESHOLD = 64 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_STEP_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts


def load_threshold(env: dict[str, str] | os._Environ = os.environ) -> int | None:
    """The mmap threshold to load under, or None to leave the allocator alone."""
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return None
    raw = env.get(ENV, str(DEFAULT_LOAD_THRESHOLD))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${ENV} must be a whole number of bytes (0 leaves glibc's defaults); got {raw!r}") from None
    if value < 0 or value > _STEP_MMAP_THRESHOLD:
        raise ValueError(f"${ENV} must be between 0 and {_STEP_MMAP_THRESHOLD} bytes; got {value}")
    return value or None


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def bounded_heap() -> Iterator[None]:
    """Run a model's loading with large buffers mapped one by one; afterwards return the freed heap's pages and
    set the thresholds for serving. A no-op off glibc or when the setting says so."""
    threshold, libc = load_threshold(), _glibc()
    if threshold is None or libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_THRESHOLD, _STEP_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _STEP_MMAP_THRESHOLD)
