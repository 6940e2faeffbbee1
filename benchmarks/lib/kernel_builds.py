"""Another source of a compiled CPU kernel (another checkout's `kernels/cpu_*.c`), built and called through this
tree's Python wrapper, checks included, so that two kernels are timed and compared alike (`benchmarks/kernels.py
paging --baseline-kernel`, `cpu-linear --baseline-kernel`)."""
from __future__ import annotations

import ctypes
from pathlib import Path
from types import ModuleType
from typing import Callable

from kvstrata.kernels import cpu_build


def wrapper_over(module: ModuleType, function: Callable, source: Path,
                 declare: Callable[[ctypes.CDLL], ctypes.CDLL],
                 flags: tuple[str, ...] | None = None) -> Callable:
    """`function` (a kernel module's wrapper, e.g. `cpu_linear.linear`) computing with the library built from
    `source` with `flags` (this CPU's by default) and given its C signatures by `declare`, in place of the library
    `module.library()` returns."""
    built = cpu_build.build(source.resolve(), cpu_build.find_compiler(), flags or cpu_build.compile_flags())
    lib = declare(ctypes.CDLL(str(built)))

    def run(*args, **kwargs):
        current = module.library
        module.library = lambda: lib
        try:
            return function(*args, **kwargs)
        finally:
            module.library = current
    return run
