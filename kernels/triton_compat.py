"""Triton when it is installed; otherwise placeholders, so that kernel modules still import and their torch
references (the CPU path) keep working on machines without Triton. Only `get_ops("triton")` needs the real one."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _MissingTriton:
        """Stands in for `triton` and `triton.language` at definition time: `@triton.jit` leaves the function as
        it is and `tl.constexpr` annotations resolve. Nothing defined with it may be launched."""

        def __getattr__(self, name: str) -> "_MissingTriton":
            return self

        def jit(self, fn):
            return fn

    triton = _MissingTriton()
    tl = _MissingTriton()

__all__ = ["HAS_TRITON", "check_launchable", "triton", "tl"]


def check_launchable(kernel: str, *tensors) -> None:
    """Raise a one-line error unless Triton can run `kernel` on `tensors`: all on one CUDA device, or anywhere
    when the CPU interpreter is on (TRITON_INTERPRET=1, as in the tests)."""
    from kvstrata.kernels.backends import triton_interpreted

    if not HAS_TRITON:
        raise RuntimeError(f"{kernel}: the triton package is not installed (use the torch backend)")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{kernel}: tensors are on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(f"{kernel}: Triton kernels need CUDA tensors, got {device} (use the torch backend)")
