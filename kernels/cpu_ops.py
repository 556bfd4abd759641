"""The project's C++ CPU kernels (kernels/csrc/*.cpp, one module), compiled on first use with torch's extension builder.

`scripts/setup.sh` builds them once; the build lands in ~/.cache/llmserve/cpu_ops/<hash of the source> (a
changed source builds anew) and later processes load it in well under a second. Where they cannot be built (no
C++ compiler, not x86-64) or LLMSERVE_CPU_KERNELS=0, `load()` returns None and the callers keep their torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("cpu_ops.cpp", "quant_matmul.cpp", "dense_matmul.cpp", "decoder_layers.cpp"))
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("LLMSERVE_CPU_KERNELS", "1") != "0" and platform.machine() in ("x86_64", "AMD64")


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


# -ffp-contract=off: no a*b+c fused where torch rounds twice. -fno-trapping-math: comparisons and selects may run on
# every lane, so loops with a branch-free select (the sampler's race, exp_any's clamp) vectorize; no rounding changes.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]


def build_dir() -> Path:
    """Keyed by the sources, their headers, the flags and the CPU's flags: the build targets this CPU
    (-march=native)."""
    headers = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *headers)) + " ".join(CFLAGS).encode()
                            + _cpu_flags()).hexdigest()[:16]
    return Path(os.path.expanduser("~")) / ".cache" / "llmserve" / "cpu_ops" / digest


def load() -> ModuleType | None:
    """The compiled module (built here when absent), or None where the kernels are off or cannot be built."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                from torch.utils.cpp_extension import load as build

                path = build_dir()
                path.mkdir(parents=True, exist_ok=True)
                _module = build(name="llmserve_cpu_ops", sources=[str(s) for s in SOURCES], build_directory=str(path),
                                extra_cflags=CFLAGS,
                                # at::parallel_for is OpenMP in the headers; libgomp.so.1 resolves to the copy
                                # torch has already loaded (same soname), so both share one thread pool
                                extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no ninja, a failed build: the torch paths still serve
                log.warning("C++ CPU kernels unavailable (%s: %s); using the torch paths", type(e).__name__, e)
                _module = None
            _tried = True
    return _module
