"""The project's C++ CPU kernels (kernels/csrc/*.cpp, one module), compiled on first use with torch's extension builder.

`scripts/setup.sh` builds them once; the build lands in ~/.cache/llmserve/cpu_ops/<hash of the source> (a
changed source builds anew) and later processes load it in well under a second. Where they cannot be built (no
C++ compiler, not x86-64) or LLMSERVE_CPU_KERNELS=0, `load()` returns None and the callers keep their torch paths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("cpu_ops.cpp", "quant_matmul.cpp", "dense_matmul.cpp", "decoder_layers.cpp",
                             "thread_binding.cpp"))
NAME = "llmserve_cpu_ops"
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; elsewhere none)."""
    return frozenset(_cpu_flags().decode().partition(":")[2].split())


# -ffp-contract=off: no a*b+c fused where torch rounds twice. -fno-trapping-math: comparisons and selects may run on
# every lane, so loops with a branch-free select (the sampler's race, exp_any's clamp) vectorize; no rounding changes.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]


def _files() -> tuple[Path, ...]:
    """The sources and the headers they include."""
    return (*SOURCES, *sorted((Path(__file__).parent / "csrc").glob("*.h")))


def build_dir() -> Path:
    """Keyed by the sources, their headers, the flags, torch's version (the build links against its C++ library)
    and the CPU's flags: the build targets this CPU (-march=native)."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in _files()) + " ".join(CFLAGS).encode()
                            + torch.__version__.encode() + _cpu_flags()).hexdigest()[:16]
    return Path(os.path.expanduser("~")) / ".cache" / "llmserve" / "cpu_ops" / digest


def _import(library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(library))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(NAME, loader))
    loader.exec_module(module)
    return module


def _load_or_build(path: Path) -> ModuleType:
    """Import a finished build, or build it first. The build runs under an flock, which the kernel releases if the
    builder dies; torch's own lock file outlives a killed builder and every later load would wait on it forever.
    The sources are copied into the build directory: torch writes their paths into its ninja file, so two checkouts
    of the same sources (a clone next to a working tree) would otherwise rebuild each other's build."""
    library, built = path / f"{NAME}.so", path / "built"
    with open(path / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        if built.exists() and library.exists():
            return _import(library)
        from torch.utils.cpp_extension import load as build

        (path / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder: a live one holds the flock
        src = path / "src"
        src.mkdir(exist_ok=True)
        for f in _files():
            shutil.copyfile(f, src / f.name)
        module = build(name=NAME, sources=[str(src / s.name) for s in SOURCES], build_directory=str(path),
                       extra_cflags=CFLAGS,
                       # at::parallel_for is OpenMP in the headers; libgomp.so.1 resolves to the copy torch has
                       # already loaded (same soname), so both share one thread pool
                       extra_ldflags=["-fopenmp"], verbose=False)
        built.touch()
        return module


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
                path = build_dir()
                path.mkdir(parents=True, exist_ok=True)
                _module = _load_or_build(path)
            except Exception as e:  # no compiler, no ninja, a failed build: the torch paths still serve
                log.warning("C++ CPU kernels unavailable (%s: %s); using the torch paths", type(e).__name__, e)
                _module = None
            _tried = True
    return _module
