"""Building and loading the compiled CPU kernels (kernels/*.c): plain C, no torch headers, built on first use by
the system C compiler into the user's cache directory, keyed by a hash of the source and the flags, and loaded with
ctypes. Each kernel module (kernels/cpu_attention.py, ...) asks `load` for its own library and declares its
functions; where there is no compiler or the build fails, one line is logged and the module runs its torch
reference.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvstrata.kernels import cpu_features

logger = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno")
VECTOR_FLAGS = ("-mavx2", "-mfma")
# Per instruction set (kernels/cpu_features.py `kernel_isa`): an AVX-512 CPU's build may use the 32 wider registers
# and 512-bit vectors wherever the compiler vectorises (conversions, copies, elementwise loops). No flag lets the compiler reorder or fuse arithmetic (-ffp-contract=off, no -ffast-math), so
# every build computes each value with the same operations in the same order: the same bits on every CPU family.
ISA_FLAGS = {
    "portable": (),
    "avx2": VECTOR_FLAGS,
    "avx512": VECTOR_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"),
}
COMPILE_TIMEOUT_S = 120


def find_compiler() -> str | None:
    """The system C compiler: `$CC`, else `cc`, else `gcc`; None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def compile_flags(isa: str | None = None) -> tuple[str, ...]:
    """The flags the kernels are built with for `isa` (default: the host CPU's, kernels/cpu_features.py `kernel_isa`,
    read at run time, so one installation builds for whatever CPU it runs on; the build cache is keyed by the flags).
    -ffp-contract=off: the compiler fuses no multiply-add on its own, so a kernel's arithmetic is what its source
    says, the same in every build."""
    return BASE_FLAGS + ISA_FLAGS[cpu_features.kernel_isa() if isa is None else isa]


def build_dir() -> Path:
    """Where built kernels are kept: `$KVSTRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstrata`, else
    `~/.cache/kvstrata` (as the engine's other caches), then `kernels/`; private to the user."""
    root = os.environ.get("KVSTRATA_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstrata")
    return Path(root) / "kernels"


def build(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library built from `source` with `flags`, compiled unless already in `build_dir()`. It is written
    under a temporary name and renamed into place, so a concurrent process never loads a half-written file."""
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # its headers
    key = hashlib.sha256(b"\0".join([text, compiler.encode(), platform.machine().encode(),
                                     *(f.encode() for f in flags)])).hexdigest()[:16]
    directory = build_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, str(source), "-o", partial, "-lm"], capture_output=True,
                                text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{Path(compiler).name} exited with {result.returncode}: {last}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(source: Path, what: str) -> ctypes.CDLL | None:
    """The kernel built from `source`, loaded; None (and one line logged) where it cannot be built or loaded.
    `what` names the kernel in that line ("attention": "...; CPU attention runs the torch reference"). The caller
    caches the answer, so the line is logged once a process."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("kvstrata: no C compiler (cc or gcc) found; CPU %s runs the torch reference", what)
        return None
    try:
        return ctypes.CDLL(str(build(source, compiler, compile_flags())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        logger.warning("kvstrata: the CPU %s kernel could not be built (%s); it runs the torch reference", what,
                       str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
