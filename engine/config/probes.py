"""What this machine's processors can do, as `auto` values need it: the dtype `model.dtype: auto`
means, and the thread count `model.threads: auto` picks.

The CPU probes read /proc/cpuinfo and ask the kernel, never torch: `kvstrata config check` must stay
cheap, and its answer must not depend on whether torch happens to be imported.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

import psutil

# `model.threads: auto` never picks more: past this, one request's matmuls gain little from more
# threads and a busy machine's scheduling noise grows (see `default_threads`).
MAX_AUTO_THREADS = 16


def auto_dtype(device: str) -> str:
    """What `model.dtype: auto` means on `device` (a resolved device: "cpu", "cuda", "cuda:N").

    On a GPU, bfloat16 where the GPU computes it natively (compute capability 8.0 and later), else
    float16. On a CPU, float32: without bfloat16 matrix units a CPU computes bfloat16 more slowly
    than float32 (measured 1.5x on a 2k-token prompt on one CPU; 60x per matrix product on one
    without AVX-512, where the engine warns at start), and float32 cache hits give exactly the
    uncached outputs. CPUs with AMX tiles multiply bfloat16 in hardware, so they get bfloat16.
    """
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return "bfloat16" if _cuda_capability(index) >= (8, 0) else "float16"
    return "bfloat16" if cpu_has_amx() else "float32"


def _cuda_capability(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


# What `dtype: auto` assumes of the CPU can be forced: "1" as if it had AMX, "0" as if not (a container
# whose /proc/cpuinfo hides the flags; the test suite, run both ways on any machine).
AMX_OVERRIDE_VARIABLE = "KVSTRATA_CPU_AMX"
_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask the kernel for an extended state component
_XFEATURE_XTILEDATA = 18       # the AMX tile data
_SYS_ARCH_PRCTL = 158          # x86_64


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles and the kernel lets this process use them.

    The same test as torch's (and oneDNN's): the CPU lists `amx_tile` and `amx_bf16`, and the kernel
    grants the tile data state (Linux asks each process to request it). Read from /proc/cpuinfo and one
    system call, never by importing torch, so the answer costs nothing and is the same in every process."""
    forced = os.environ.get(AMX_OVERRIDE_VARIABLE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    flags = _cpuinfo_flags()
    if flags is None or not {"amx_tile", "amx_bf16"} <= flags:
        return False
    return _kernel_grants_amx()


@functools.cache
def _kernel_grants_amx() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _cpuinfo_flags() -> set[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo; None where it does not say (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return None


def default_threads() -> int:
    """The torch thread count `model.threads: auto` picks: one per physical core this process may
    run on, at most `MAX_AUTO_THREADS`, and one on a machine with two cores or fewer.

    Why one there: intra-op threads meet at a barrier after every operator, so a request runs at the
    pace of its slowest thread, and on two cores any other busy process deschedules one of the two.
    Measured on a 2-core machine shared with other work (benchmarks/results/archive/threads.md): with two
    threads a 58-token prompt took 15x longer at the median than with one (13 s against 0.9 s) and
    a 500-token prefill 4x longer. Where the machine is otherwise idle, `model.threads: 2` may be faster.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or usable
    cores = min(usable, physical)
    return 1 if cores <= 2 else min(cores, MAX_AUTO_THREADS)
