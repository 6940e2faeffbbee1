"""One CPU probe (kernels/cpu_features.py) for the engine's `dtype: auto` and the kernels' batch-invariant tiles:
they agree on every CPU, one override forces both, and the kernels read it without importing the engine."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstrata.engine.config import load_config, probes
from kvstrata.kernels import batch_invariant, cpu_features


@pytest.mark.parametrize("forced, family, dtype", [("1", "amx", "bfloat16"), ("0", None, "float32")])
def test_the_amx_override_moves_the_engines_dtype_and_the_kernels_tile_together(monkeypatch, forced, family, dtype):
    monkeypatch.setenv(cpu_features.AMX_OVERRIDE_VARIABLE, forced)
    assert load_config({"model": {"device": "cpu"}}).resolved_dtype() == dtype
    isa = batch_invariant.cpu_matrix_isa()
    assert isa == family if family else isa in ("avx512", "avx2")
    assert batch_invariant.linear_tile_rows(torch.bfloat16) == batch_invariant.LINEAR_TILE_ROWS[(isa, torch.bfloat16)]


def test_without_the_override_both_read_the_same_flags(monkeypatch):
    monkeypatch.delenv(cpu_features.AMX_OVERRIDE_VARIABLE, raising=False)
    assert (batch_invariant.cpu_matrix_isa() == "amx") == probes.cpu_has_amx()


@pytest.mark.parametrize("flags, amx, family", [
    ({"avx2", "fma"}, False, "avx2"),
    ({"avx512f", "avx512_bf16"}, False, "avx512"),
    ({"avx512f", "amx_tile", "amx_bf16"}, True, "amx"),
    ({"avx512f", "amx_tile", "amx_bf16"}, False, "avx512"),  # a kernel that refuses the tile state, or forced off
    (None, False, "avx2"),                                   # no /proc/cpuinfo
])
def test_the_matrix_family_follows_the_flags_and_the_amx_answer(flags, amx, family):
    assert cpu_features.matrix_family(flags, amx) == family
    assert cpu_features.amx_usable(flags, kernel_grants=True) == (flags is not None and cpu_features.AMX_FLAGS <= flags)


def test_the_kernels_probe_the_cpu_without_importing_the_engine():
    probe = ("import sys\nfrom kvstrata.kernels import batch_invariant\nbatch_invariant.cpu_matrix_isa()\n"
             "assert not [m for m in sys.modules if m.startswith('kvstrata.engine')]\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags, isa", [
    (None, "portable"),                                            # no /proc/cpuinfo
    ({"sse4_2", "avx"}, "portable"),
    ({"avx2"}, "portable"),                                        # AVX2 without FMA
    ({"avx2", "fma"}, "avx2"),                                     # Zen 1-3, Haswell to Alder Lake
    ({"avx2", "fma", "avx512f"}, "avx2"),                          # AVX-512 without its BW, VL and DQ parts
    (AVX512, "avx512"),                                            # Skylake-SP, Ice Lake, Zen 4 and 5
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512"),  # Sapphire Rapids: AMX is torch's, not ours
])
def test_the_compiled_kernels_are_built_for_the_widest_instruction_set_the_cpu_has(monkeypatch, flags, isa):
    from kvstrata.kernels import cpu_build

    monkeypatch.setattr(cpu_features, "cpuinfo_flags", lambda: None if flags is None else frozenset(flags))
    assert cpu_features.kernel_isa(flags) == cpu_features.kernel_isa() == isa
    built_for = cpu_build.compile_flags()
    assert built_for == cpu_build.BASE_FLAGS + cpu_build.ISA_FLAGS[isa]
    assert ("-mavx2" in built_for) == (isa != "portable") and ("-mavx512f" in built_for) == (isa == "avx512")
    assert "-ffp-contract=off" in built_for and not any("fast-math" in flag for flag in built_for)


@pytest.mark.parametrize("source", ["cpu_attention", "cpu_linear", "cpu_layer_ops"])
def test_every_instruction_sets_build_compiles_on_any_x86_64_host_into_its_own_cache_entry(rebuilt, source):
    """The C compiler emits AVX-512 code whatever CPU it runs on: each kernel builds for every instruction set
    here (the builds this CPU cannot run are compiled, not loaded), each into a library of its own."""
    import platform
    from pathlib import Path

    from kvstrata.kernels import cpu_build

    compiler = cpu_build.find_compiler()
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    kernel = Path(cpu_features.__file__).with_name(f"{source}.c")
    paths = {isa: cpu_build.build(kernel, compiler, cpu_build.compile_flags(isa)) for isa in cpu_features.KERNEL_ISAS}
    assert len(set(paths.values())) == len(cpu_features.KERNEL_ISAS)
    assert all(path.exists() and path.parent == rebuilt for path in paths.values())


def test_an_avx512_build_gives_the_avx2_builds_bits(rebuilt, monkeypatch):
    """Where the CPU runs AVX-512: attention, products and layer ops built for it give the AVX2 build's bits (the
    flags let the compiler widen vectors, never reorder or fuse arithmetic). Skipped on a CPU without AVX-512."""
    if cpu_features.kernel_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512 (AVX512F, BW, VL and DQ): its builds compile here but cannot run")
    from kernel_cases import make_paged_problem

    from kvstrata.kernels import cpu_attention, cpu_layer_ops, cpu_linear

    problem = make_paged_problem([(0, 70), (40, 1), (9, 200)], num_heads=9, num_kv_heads=3, head_dim=64,
                                 block_size=16, dtype=torch.bfloat16, seed=2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen)
    weight = torch.randn(96, 200, generator=gen).t()

    def compute(isa: str) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_features, "kernel_isa", lambda flags=None: isa)
        for module in (cpu_attention, cpu_linear, cpu_layer_ops):
            module.library.cache_clear()
        out = [cpu_attention.prefix_prefill(*problem.args(), batch_invariant=True)]
        for dtype in (torch.float32, torch.bfloat16):
            out.append(cpu_linear.linear(x.to(dtype), weight.to(dtype)))
            out.extend(t for t in cpu_layer_ops.rms_norm(x.to(dtype), torch.ones(96, dtype=dtype), 1e-5)
                       if t is not None)
        return out

    assert all(torch.equal(a, b) for a, b in zip(compute("avx512"), compute("avx2")))
    assert len(list(rebuilt.iterdir())) == 6  # three kernels, two builds each
