"""The ISA tiers the C++ CPU kernels are built for, and which one a process loads.

Each tier is an explicit compiler target (never -march=native), so that a build's code is the same whatever machine
compiled it, and a machine can build and test every tier its CPU executes, not only its own best. The tiers follow
the x86-64 psABI levels, plus the extensions the kernels use on top of AVX-512:

- x86-64-v2: SSE4.2, no AVX2: the portable loops only (no matmuls, no layer loop: those ops are absent).
- x86-64-v3: AVX2 + FMA: the 8-lane attention, the quantized and float32 panel matmuls, the layer loop.
- x86-64-v4: AVX-512 F/BW/CD/DQ/VL: the 16-lane attention and matmul tiles.
- x86-64-v4-vnni: + AVX512-VNNI: the integer-activation dot products of the quantized matmuls.
- x86-64-v4-bf16: + AVX512-BF16: bfloat16 attention dots and bfloat16 panel matmuls (vdpbf16ps).
- x86-64-v4-amx: + AMX-TILE / AMX-BF16: bfloat16 attention and matmuls in tiles.

Pure: plain data in and out; `kernels.cpu_ops` reads /proc/cpuinfo and the environment and builds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ENV = "LLMSERVE_CPU_ISA"  # forces one tier by name; unset or "auto": the best tier this CPU executes


@dataclass(frozen=True)
class IsaTier:
    name: str
    flags: tuple[str, ...]  # the compiler's target flags
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must show to execute the build (this tier's and below)


def _chain(*steps: tuple[str, tuple[str, ...], tuple[str, ...]]) -> tuple[IsaTier, ...]:
    """Each tier needs what the one below needs and its own flags."""
    tiers, needs = [], frozenset[str]()
    for name, flags, own_needs in steps:
        needs = needs | frozenset(own_needs)
        tiers.append(IsaTier(name, flags, needs))
    return tuple(tiers)


_V4 = ("-march=x86-64-v4",)
TIERS: tuple[IsaTier, ...] = _chain(
    ("x86-64-v2", ("-march=x86-64-v2",), ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")),
    # cpuinfo calls LZCNT "abm"
    ("x86-64-v3", ("-march=x86-64-v3",), ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")),
    ("x86-64-v4", _V4, ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    ("x86-64-v4-vnni", (*_V4, "-mavx512vnni"), ("avx512_vnni",)),
    ("x86-64-v4-bf16", (*_V4, "-mavx512vnni", "-mavx512bf16"), ("avx512_bf16",)),
    ("x86-64-v4-amx", (*_V4, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"), ("amx_tile", "amx_bf16")),
)
NAMES = tuple(t.name for t in TIERS)


def by_name(name: str) -> IsaTier:
    for tier in TIERS:
        if tier.name == name:
            return tier
    raise ValueError(f"{ENV}={name!r}: not an ISA tier; choose one of {', '.join(NAMES)} or auto")


def runnable(cpu_flags: Iterable[str]) -> tuple[IsaTier, ...]:
    """The tiers a CPU with these flags executes, lowest first (none on a CPU without SSE4.2, or not x86-64)."""
    flags = frozenset(cpu_flags)
    return tuple(t for t in TIERS if t.needs <= flags)


def choose(cpu_flags: Iterable[str], forced: str | None = None) -> IsaTier | None:
    """The tier to load: `forced` (a name; refused where this CPU cannot execute it), else the best this CPU
    executes; None where it executes none."""
    flags = frozenset(cpu_flags)
    if forced and forced != "auto":
        tier = by_name(forced)
        if missing := sorted(tier.needs - flags):
            raise ValueError(f"{ENV}={forced}: this CPU lacks {', '.join(missing)}; "
                             f"it executes {', '.join(t.name for t in runnable(flags)) or 'no tier'}")
        return tier
    tiers = runnable(flags)
    return tiers[-1] if tiers else None
