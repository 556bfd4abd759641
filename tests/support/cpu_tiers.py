"""Which ISA tiers of the C++ CPU kernels (kernels/cpu_isa.py) the kernel tests run on this machine.

Each tier is its own build (~30 s on 2 cores), so by default a run tests two: the tier the worker loads here (the
best this CPU executes) and one more -- x86-64-v3 (the AVX2 paths) where the default is an AVX-512 tier, else the tier
below the default (x86-64-v2's portable loops on an AVX2 CPU). LLMSERVE_TEST_CPU_ISAS=all tests every tier this CPU
executes; a comma-separated list names them.
"""

from __future__ import annotations

import os

import pytest

from kernels import cpu_isa, cpu_ops

ENV = "LLMSERVE_TEST_CPU_ISAS"


def kernel_test_tiers(lowest: str = "x86-64-v2") -> list[str]:
    """The tier names to test, lowest first, none below `lowest` (the matmuls exist from x86-64-v3 on)."""
    runnable = [t.name for t in cpu_ops.runnable_tiers()]
    wanted = os.environ.get(ENV, "")
    if wanted == "all":
        names = runnable
    elif wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        for name in names:
            if name not in runnable:
                raise ValueError(f"{ENV}: {name!r} is not a tier this CPU executes ({', '.join(runnable)})")
    else:
        default = cpu_ops.tier()
        if default is None:
            return []
        i = runnable.index(default.name)
        above_avx2 = "x86-64-v3" in runnable and i > runnable.index("x86-64-v3")
        other = "x86-64-v3" if above_avx2 else runnable[i - 1] if i > 0 else None
        names = [n for n in runnable if n in (default.name, other)]
    floor = cpu_isa.NAMES.index(lowest)
    return [n for n in names if cpu_isa.NAMES.index(n) >= floor]


def tier_ops(name: str, monkeypatch: pytest.MonkeyPatch):
    """Tier `name`'s module, built here if absent, made the process's default for the test (what `cpu_ops.load()`
    returns, and LLMSERVE_CPU_ISA for `cpu_ops.tier()`), so that callers going through `cpu_ops.load()`
    (kernels.reference, worker_svc) run the same build."""
    module = cpu_ops.load(name)
    assert module is not None, f"the {name} build of kernels/csrc failed: see the warning logged by kernels.cpu_ops"
    monkeypatch.setenv(cpu_isa.ENV, name)
    monkeypatch.setattr(cpu_ops, "_default", [module])
    return module
