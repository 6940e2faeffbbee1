"""What the host CPU's matrix units are, read from /proc/cpuinfo and one system call, never from torch: the one probe
that both the engine (`model.dtype: auto`, engine/config/probes.py) and the kernels (the batch-invariant linear's
tile, kernels/batch_invariant.py) ask, so they can never disagree, and one override for both.

Torch-free: `kvstrata config check` asks it without importing torch.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

# What is assumed of the CPU's AMX can be forced: "1" as if it had AMX, "0" as if not (a container whose
# /proc/cpuinfo hides the flags; the test suite, run both ways on any machine).
AMX_OVERRIDE_VARIABLE = "KVSTRATA_CPU_AMX"
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask the kernel for an extended state component
_XFEATURE_XTILEDATA = 18       # the AMX tile data
_SYS_ARCH_PRCTL = 158          # x86_64


def forced_amx() -> bool | None:
    """The override's answer: True or False where `KVSTRATA_CPU_AMX` is "1" or "0", else None."""
    forced = os.environ.get(AMX_OVERRIDE_VARIABLE, "").strip()
    return forced == "1" if forced in ("0", "1") else None


def amx_usable(flags: set[str] | None, kernel_grants: bool | None = None) -> bool:
    """torch's (and oneDNN's) test: the CPU lists `amx_tile` and `amx_bf16`, and the kernel grants this process
    the tile data state (Linux asks each process to request it). `kernel_grants` None: ask the kernel."""
    if flags is None or not AMX_FLAGS <= flags:
        return False
    return kernel_grants_amx() if kernel_grants is None else kernel_grants


@functools.cache
def kernel_grants_amx() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def cpuinfo_flags() -> frozenset[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo; None where it does not say (not Linux). Read once: the
    batch-invariant products ask for the CPU's family at every call."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def matrix_family(flags: set[str] | None, amx: bool) -> str:
    """'amx', 'avx512' or 'avx2' (anything narrower counts as avx2): the widest unit a CPU GEMM may use, given the
    CPU's flags and the AMX answer (`forced_amx()` or `amx_usable`)."""
    if amx:
        return "amx"
    return "avx512" if flags is not None and "avx512f" in flags else "avx2"


def cpu_matrix_family() -> str:
    """The host CPU's `matrix_family`, the override honoured."""
    flags = cpuinfo_flags()
    forced = forced_amx()
    return matrix_family(flags, amx_usable(flags) if forced is None else forced)


# What the compiled CPU kernels (kernels/cpu_build.py) are built for beyond the baseline: AVX2 and FMA together.
VECTOR_FLAGS = ("avx2", "fma")
# ... and AVX-512 beside them: the foundation and the byte/word, vector-length and doubleword/quadword extensions
# (every AVX-512 CPU has all four, AMX CPUs included).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# The instruction sets the compiled kernels are built for, widest first: each CPU gets the widest it has.
KERNEL_ISAS = ("avx512", "avx2", "portable")


def has_avx2_fma(flags: set[str] | None = None) -> bool:
    """Whether the host's CPU (or one with `flags`) has AVX2 and FMA, so that kernels may be compiled with -mavx2 -mfma."""
    flags = cpuinfo_flags() if flags is None else flags
    return flags is not None and all(flag in flags for flag in VECTOR_FLAGS)


def kernel_isa(flags: set[str] | None = None) -> str:
    """The instruction set the compiled kernels are built for on the host's CPU (or one with `flags`): 'avx512' where it
    has AVX2, FMA and `AVX512_FLAGS`, 'avx2' where it has AVX2 and FMA, else 'portable' (plain C)."""
    flags = cpuinfo_flags() if flags is None else flags
    if not has_avx2_fma(flags):
        return "portable"
    return "avx512" if all(flag in flags for flag in AVX512_FLAGS) else "avx2"
