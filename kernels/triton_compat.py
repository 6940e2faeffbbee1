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

__all__ = ["HAS_TRITON", "triton", "tl"]
