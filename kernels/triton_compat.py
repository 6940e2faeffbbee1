"""Triton, imported only when a Triton kernel is first launched.

A kernel module defines its kernels with `@jit` and names `triton` and `tl` from here. Until one of its kernels
launches, those are stand-ins: `@jit` keeps the plain function, and `triton.cdiv` and the like import Triton on
first use. So the CPU and torch backends, which call only the torch references beside the kernels, never import
Triton nor build any of its objects (whose bindings report them as leaked at exit). At the first launch the module
is switched over: its `triton` and `tl` become the real modules and every `@jit` function in it becomes
`triton.jit` of itself, so that kernels calling helper kernels find them as Triton expects."""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["HAS_TRITON", "check_launchable", "jit", "triton", "triton_kernel", "tl"]


class _LazyModule:
    """Stands in for `triton` or `triton.language` in a kernel module: an attribute imports the real module."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if not HAS_TRITON:
            raise RuntimeError(f"{self._name}.{attr}: the triton package is not installed (use the torch backend)")
        return getattr(importlib.import_module(self._name), attr)


triton = _LazyModule("triton")
tl = _LazyModule("triton.language")


class LazyKernel:
    """A `@jit` function before its module's first launch: indexing it with a grid (`kernel[grid](...)`) switches
    the module over to Triton and launches the real kernel."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getitem__(self, grid):
        return _switch_to_triton(self.fn.__globals__)[self.fn.__name__][grid]

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)  # as a plain function; inside a kernel the module is already switched


def jit(fn):
    """`triton.jit`, deferred to the first launch of a kernel of `fn`'s module."""
    return LazyKernel(fn)


def triton_kernel(kernel):
    """The Triton kernel (`triton.jit` of its function) that `kernel` stands for, its module switched over: for
    Triton's own tools, such as `triton.compile` of an `ASTSource`."""
    if isinstance(kernel, LazyKernel):
        return _switch_to_triton(kernel.fn.__globals__)[kernel.fn.__name__]
    return kernel


def _switch_to_triton(module_globals: dict[str, Any]) -> dict[str, Any]:
    """Give a kernel module the real `triton` and `tl`, and turn each of its `LazyKernel`s into `triton.jit` of its
    function. Idempotent; returns the module's globals."""
    if not HAS_TRITON:
        raise RuntimeError("Triton kernels: the triton package is not installed (use the torch backend)")
    real_triton = importlib.import_module("triton")
    module_globals["triton"] = real_triton
    module_globals["tl"] = importlib.import_module("triton.language")
    for name, value in list(module_globals.items()):
        if isinstance(value, LazyKernel) and value.fn.__globals__ is module_globals:
            module_globals[name] = real_triton.jit(value.fn)
    return module_globals


def triton_interpreted() -> bool:
    """True when Triton kernels run through its CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_launchable(kernel: str, *tensors) -> None:
    """Raise a one-line error unless Triton can run `kernel` on `tensors`: all on one CUDA device, or anywhere
    when the CPU interpreter is on (TRITON_INTERPRET=1, as in the tests)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{kernel}: the triton package is not installed (use the torch backend)")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{kernel}: tensors are on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(f"{kernel}: Triton kernels need CUDA tensors, got {device} (use the torch backend)")
