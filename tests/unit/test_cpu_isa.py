"""The ISA tiers of the C++ CPU kernels (kernels/cpu_isa.py): which a CPU executes, which a process loads, how one is
forced, and that every tier builds apart from the others (kernels/cpu_ops.py)."""

from __future__ import annotations

import subprocess

import pytest

from kernels import cpu_isa, cpu_ops

# /proc/cpuinfo flags of three real CPUs (abridged to what the tiers ask)
V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
AVX2_BOX = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # Zen 2/3, Haswell on
ZEN4 = AVX2_BOX | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def names(tiers) -> list[str]:
    return [t.name for t in tiers]


def test_the_tiers_are_a_chain_each_needing_all_below():
    for lower, higher in zip(cpu_isa.TIERS, cpu_isa.TIERS[1:], strict=False):
        assert lower.needs < higher.needs
    assert all(t.flags[0].startswith("-march=x86-64-v") for t in cpu_isa.TIERS)  # never -march=native


@pytest.mark.parametrize("flags, best, count", [(V2, "x86-64-v2", 1), (AVX2_BOX, "x86-64-v3", 2),
                                                (ZEN4, "x86-64-v4-bf16", 5), (SAPPHIRE_RAPIDS, "x86-64-v4-amx", 6)])
def test_the_default_is_the_best_tier_the_cpu_executes(flags, best, count):
    assert cpu_isa.choose(flags).name == best
    assert len(cpu_isa.runnable(flags)) == count and names(cpu_isa.runnable(flags))[-1] == best


def test_avx512_without_vnni_stops_at_x86_64_v4():
    skylake_x = AVX2_BOX | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert cpu_isa.choose(skylake_x).name == "x86-64-v4"


def test_a_cpu_without_sse4_executes_no_tier():
    assert cpu_isa.choose({"sse2"}) is None and cpu_isa.runnable(set()) == ()


def test_a_tier_is_forced_by_name_and_auto_means_the_default():
    assert cpu_isa.choose(ZEN4, "x86-64-v3").name == "x86-64-v3"
    assert cpu_isa.choose(ZEN4, "auto").name == "x86-64-v4-bf16"


def test_forcing_a_tier_the_cpu_cannot_execute_names_what_is_missing():
    with pytest.raises(ValueError, match=r"LLMSERVE_CPU_ISA=x86-64-v4-amx: this CPU lacks amx_bf16, amx_tile; "
                                         r"it executes x86-64-v2, .*x86-64-v4-bf16"):
        cpu_isa.choose(ZEN4, "x86-64-v4-amx")


def test_an_unknown_tier_is_refused_naming_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"LLMSERVE_CPU_ISA='native': not an ISA tier; choose one of x86-64-v2, "):
        cpu_isa.choose(ZEN4, "native")


def test_the_environment_picks_the_tier_a_process_loads(monkeypatch):
    best = cpu_ops.runnable_tiers()[-1]
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_ops.tier() == best
    lowest = cpu_ops.runnable_tiers()[0]
    monkeypatch.setenv(cpu_isa.ENV, lowest.name)
    assert cpu_ops.tier() == lowest
    assert cpu_ops.tier(best.name) == best  # an explicit argument wins over the environment
    monkeypatch.setenv(cpu_isa.ENV, "x86-64-v9")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA='x86-64-v9'"):
        cpu_ops.tier()
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA='x86-64-v9'"):
        cpu_ops.load("x86-64-v9")


def test_each_tier_builds_in_its_own_directory_under_its_own_name():
    dirs = {cpu_ops.build_dir(t) for t in cpu_isa.TIERS}
    assert len(dirs) == len(cpu_isa.TIERS)
    assert len({cpu_ops.module_name(t) for t in cpu_isa.TIERS}) == len(cpu_isa.TIERS)
    for t in cpu_isa.TIERS:
        assert cpu_ops.cflags(t)[-len(t.flags):] == list(t.flags) and "-march=native" not in cpu_ops.cflags(t)


@pytest.mark.slow  # ~2 x 8 compiles of torch's headers; not linked, not loaded
@pytest.mark.parametrize("name", ["x86-64-v4", "x86-64-v4-amx"])  # together every #if branch of the AVX-512 tiers
def test_the_avx512_tiers_compile_on_any_machine(name, tmp_path):
    try:
        cpu_ops.compile_only(cpu_isa.by_name(name), tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"{name}: {' '.join(e.cmd[-3:])}\n{e.stderr[-4000:]}")
    assert {p.stem for p in tmp_path.glob("*.o")} == {s.stem for s in cpu_ops.SOURCES}
