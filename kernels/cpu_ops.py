"""The project's C++ CPU kernels (kernels/csrc/*.cpp, one module), compiled on first use with torch's extension builder.

Built for one ISA tier (`kernels.cpu_isa`: an explicit -march target): by default the best this CPU executes,
or the one named by LLMSERVE_CPU_ISA (e.g. x86-64-v3), or `load(isa=...)`'s. `scripts/setup.sh` builds the default
once; each build lands in ~/.cache/llmserve/cpu_ops/<hash of the sources and flags> (a changed source or another tier
builds anew) and later processes load it in well under a second. Where they cannot be built (no C++ compiler, not
x86-64) or LLMSERVE_CPU_KERNELS=0, `load()` returns None and the callers keep their torch paths.
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
import subprocess
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

import torch

from kernels import cpu_isa
from kernels.cpu_isa import IsaTier

log = logging.getLogger(__name__)

# one file per job: attention, sampling, elementwise, dense and quantized matmuls, the layer loop, the module
SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("paged_attention.cpp", "sampling.cpp", "elementwise.cpp", "dense_matmul.cpp",
                             "quant_matmul.cpp", "decoder_layers.cpp", "thread_binding.cpp", "module.cpp"))
NAME = "llmserve_cpu_ops"
_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}  # by tier name; None: tried and failed
# what load() returns when asked for no tier, fixed by its first such call (LLMSERVE_CPU_ISA is read then): the model
# asks once per layer and matmul, and reading the environment each time would cost more than the rest of the call
_default: list[ModuleType | None] = []


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
# The target (-march=...) comes from the tier (`cflags`).
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]


def tier(isa: str | None = None) -> IsaTier | None:
    """The tier `load(isa)` builds: `isa`, else LLMSERVE_CPU_ISA, else the best this CPU executes (None: none).
    A name this CPU cannot execute is refused (ValueError naming it and what is missing)."""
    return cpu_isa.choose(cpu_flags(), isa or os.environ.get(cpu_isa.ENV))


def runnable_tiers() -> tuple[IsaTier, ...]:
    """Every tier this CPU executes, lowest first."""
    return cpu_isa.runnable(cpu_flags())


def cflags(t: IsaTier) -> list[str]:
    return [*CFLAGS, *t.flags]


def module_name(t: IsaTier) -> str:
    """One name per tier, so that two tiers' builds can be imported into one process (the tests compare them)."""
    return f"{NAME}_{t.name.replace('-', '_')}"


def _files() -> tuple[Path, ...]:
    """The sources and the headers they include."""
    return (*SOURCES, *sorted((Path(__file__).parent / "csrc").glob("*.h")))


def build_dir(t: IsaTier | None = None) -> Path:
    """Keyed by the sources, their headers, the flags (the tier's target among them) and torch's version (the build
    links against its C++ library). The build depends on the tier, not on the CPU that compiled it."""
    t = t or tier()
    if t is None:
        raise RuntimeError("this CPU executes no ISA tier of the C++ kernels")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in _files()) + " ".join(cflags(t)).encode()
                            + module_name(t).encode() + torch.__version__.encode()).hexdigest()[:16]
    return Path(os.path.expanduser("~")) / ".cache" / "llmserve" / "cpu_ops" / digest


def _import(library: Path, name: str | None = None) -> ModuleType:
    """Import a built library; its module name is the one it was built under (the file's stem)."""
    name = name or library.stem
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def _load_or_build(path: Path, t: IsaTier) -> ModuleType:
    """Import a finished build, or build it first. The build runs under an flock, which the kernel releases if the
    builder dies; torch's own lock file outlives a killed builder and every later load would wait on it forever.
    The sources are copied into the build directory: torch writes their paths into its ninja file, so two checkouts
    of the same sources (a clone next to a working tree) would otherwise rebuild each other's build."""
    name = module_name(t)
    library, built = path / f"{name}.so", path / "built"
    with open(path / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        if built.exists() and library.exists():
            return _import(library, name)
        from torch.utils.cpp_extension import load as build

        (path / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder: a live one holds the flock
        src = path / "src"
        src.mkdir(exist_ok=True)
        for f in _files():
            shutil.copyfile(f, src / f.name)
        module = build(name=name, sources=[str(src / s.name) for s in SOURCES], build_directory=str(path),
                       extra_cflags=cflags(t),
                       # at::parallel_for is OpenMP in the headers; libgomp.so.1 resolves to the copy torch has
                       # already loaded (same soname), so both share one thread pool
                       extra_ldflags=["-fopenmp"], verbose=False)
        built.touch()
        return module


def compile_only(t: IsaTier, out: Path) -> None:
    """Compile every source for tier `t` into `out`, without linking or importing: a build of a tier this CPU cannot
    execute would die of an illegal instruction on import, but each #if branch still has to compile under its tier
    (the intrinsics' target checks run at -O0 too; CalledProcessError with the compiler's message otherwise)."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    flags = [f for f in cflags(t) if f != "-O3"]
    for src in SOURCES:
        subprocess.run(["g++", "-std=c++20", "-fPIC", "-O0", "-w", f"-DTORCH_EXTENSION_NAME={module_name(t)}",
                        *flags, *includes, "-c", str(src), "-o", str(out / f"{src.stem}.o")],
                       check=True, capture_output=True, text=True)


def load(isa: str | None = None) -> ModuleType | None:
    """The compiled module of tier `isa` (default: `tier()`, chosen once per process), built here when absent, or
    None where the kernels are off or cannot be built. Each tier is built, cached and imported on its own."""
    if not enabled():
        return None
    if isa is None and _default:
        return _default[0]
    t = tier(isa)
    if t is None:
        return None
    with _lock:
        if t.name not in _modules:
            try:
                path = build_dir(t)
                path.mkdir(parents=True, exist_ok=True)
                _modules[t.name] = _load_or_build(path, t)
                log.info("C++ CPU kernels: ISA tier %s", t.name)
            except Exception as e:  # no compiler, no ninja, a failed build: the torch paths still serve
                log.warning("C++ CPU kernels (%s) unavailable (%s: %s); using the torch paths", t.name,
                            type(e).__name__, e)
                _modules[t.name] = None
        if isa is None and not _default:
            _default.append(_modules[t.name])
    return _modules[t.name]
