"""What the host's processors can do, as `auto` values need it: the dtype `model.dtype: auto`
means, and the thread count `model.threads: auto` picks.

The CPU probes read /proc/cpuinfo and ask the kernel, never torch: `kvstrata config check` must stay
cheap, and its answer must not depend on whether torch happens to be imported.
"""
from __future__ import annotations

import os

import psutil

from kvstrata.kernels import cpu_features

# `model.threads: auto` never picks more: past this, one request's matmuls gain little from more
# threads and a busy machine's scheduling noise grows (see `default_threads`).
MAX_AUTO_THREADS = 16


def auto_dtype(device: str) -> str:
    """What `model.dtype: auto` means on `device` (a resolved device: "cpu", "cuda", "cuda:N").

    On a GPU, bfloat16 where the GPU computes it natively (compute capability 8.0 and later), else
    float16. On a CPU, float32: without bfloat16 matrix units a CPU computes bfloat16 more slowly
    than float32 (far more slowly without AVX-512, where the engine warns at start), and float32
    cache hits give exactly the uncached outputs. CPUs with AMX tiles multiply bfloat16 in hardware,
    so they get bfloat16.
    """
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return "bfloat16" if _cuda_capability(index) >= (8, 0) else "float16"
    return "bfloat16" if cpu_has_amx() else "float32"


def _cuda_capability(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


# The CPU's flags are read by kernels/cpu_features.py, which the kernels ask too; the names here stay so that tests
# patch the flags and the kernel's answer for this module alone.
AMX_OVERRIDE_VARIABLE = cpu_features.AMX_OVERRIDE_VARIABLE


def cpu_has_amx() -> bool:
    """Whether the host's CPU multiplies bfloat16 in AMX tiles and the kernel lets this process use them
    (`KVSTRATA_CPU_AMX` forces the answer).

    The same test as torch's (and oneDNN's): the CPU lists `amx_tile` and `amx_bf16`, and the kernel
    grants the tile data state (Linux asks each process to request it). Read from /proc/cpuinfo and one
    system call, never by importing torch, so the answer costs nothing and is the same in every process."""
    forced = cpu_features.forced_amx()
    if forced is not None:
        return forced
    flags = _cpuinfo_flags()
    return flags is not None and cpu_features.AMX_FLAGS <= flags and _kernel_grants_amx()


def _kernel_grants_amx() -> bool:
    return cpu_features.kernel_grants_amx()


def _cpuinfo_flags() -> set[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo; None where it does not say (not Linux)."""
    return cpu_features.cpuinfo_flags()


def default_threads() -> int:
    """The torch thread count `model.threads: auto` picks: one per physical core this process may
    run on, at most `MAX_AUTO_THREADS`, and one on a machine with two cores or fewer.

    Why one there: intra-op threads meet at a barrier after every operator, so a request runs at the
    pace of its slowest thread, and on two cores any other busy process deschedules one of the two:
    with a second thread, short prompts swung to many times their one-thread time whenever anything
    else ran, and long prefills slowed too. Where the machine is otherwise idle, `model.threads: 2`
    may be faster.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or usable
    cores = min(usable, physical)
    return 1 if cores <= 2 else min(cores, MAX_AUTO_THREADS)
