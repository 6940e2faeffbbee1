"""Triton kernels, each with a torch reference beside it. Knows nothing of tiers or the engine: plain tensors in,
tensors out.

The engine asks `get_ops(resolve_backend(config.model.attention_backend, device))` once and calls the returned
`KernelOps`. Importing this package never imports Triton; only `get_ops("triton")` does. Backends: "triton" (CUDA),
"cpu" (the torch ops with attention, the linear layers, RMSNorm, rotary, SiLU-and-mul and the K/V store by
compiled CPU kernels, kernels/cpu_attention.py, kernels/cpu_linear.py and kernels/cpu_layer_ops.py, built on first
use) and "torch" (the pure references, which run anywhere).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvstrata.kernels.triton_compat import triton_interpreted

if TYPE_CHECKING:
    import torch

BACKENDS = ("triton", "cpu", "torch")
_CHOICES = "auto, triton, cpu, torch"
_NO_CPU_KERNEL = ("model.attention_backend: 'cpu' needs a C compiler (cc or gcc) to build its attention kernel, and "
                  "none worked here (use 'torch' or 'auto')")


@dataclass(frozen=True)
class KernelOps:
    """The kernels one backend provides, all with the signatures of the torch references. With `batch_invariant`,
    `prefix_prefill` is the batch-invariant attention, and the model's products are `linear`: where `intercept`,
    the model runner routes the model's own `F.linear` and last-axis means to `linear` / `mean_last_dim`
    (engine/batch_invariant.py); elsewhere (backend "cpu", whose every op is invariant by itself) `model_linear`
    is `linear` and nothing needs intercepting."""

    name: str
    store_kv: Callable[..., None]
    prefix_prefill: Callable[..., torch.Tensor]
    gather_blocks: Callable[..., torch.Tensor]
    scatter_blocks: Callable[..., None]
    linear: Callable[..., torch.Tensor]
    mean_last_dim: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., torch.Tensor]
    silu_and_mul: Callable[..., torch.Tensor]
    batch_invariant: bool = False
    # The default mode's products (the decoder's and the vocabulary's), where a backend's kernel is faster than
    # `F.linear`; None: `F.linear` (and always in the invariant mode, which routes `F.linear` to `linear`).
    model_linear: Callable[..., torch.Tensor] | None = None
    intercept: bool = False


@functools.cache
def triton_available() -> bool:
    """True when Triton imports here (it is absent on some machines; the torch path works without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cpu_kernel_available() -> bool:
    """True when the compiled CPU attention kernel builds (or was built) and loads here (kernels/cpu_attention.py:
    a C compiler is needed; without one it logs one line and this is False)."""
    from kvstrata.kernels import cpu_attention

    return cpu_attention.available()


def get_ops(backend: str, batch_invariant: bool = False) -> KernelOps:
    """The kernels of `backend` ("triton", "cpu" or "torch"), in batch-invariant mode if asked."""
    if backend == "cpu":
        if not cpu_kernel_available():
            raise ValueError(_NO_CPU_KERNEL)
        from kvstrata.kernels import batch_invariant as invariant
        from kvstrata.kernels import cpu_attention, cpu_layer_ops, cpu_linear

        # The torch ops but attention, the products and the layer ops, whose compiled kernels are batch-invariant
        # in both modes (a product the linear kernel does not take runs the invariant reference: never `F.linear`,
        # which the invariant mode routes here).
        ops = dataclasses.replace(get_ops("torch"), name="cpu", prefix_prefill=cpu_attention.prefix_prefill,
                                  linear=functools.partial(cpu_linear.linear, fallback=invariant.reference_linear),
                                  model_linear=cpu_linear.model_linear)
        ops = dataclasses.replace(ops, **cpu_layer_ops.OPS)  # compiled norm, rotary, SiLU, K/V store; row-invariant
    elif backend == "torch":
        from kvstrata.kernels import batch_invariant as invariant
        from kvstrata.kernels import block_copy, kv_store, layer_ops, prefix_prefill

        ops = KernelOps(name="torch", store_kv=kv_store.reference_store_kv,
                        prefix_prefill=prefix_prefill.reference_prefix_prefill,
                        gather_blocks=block_copy.reference_gather_blocks,
                        scatter_blocks=block_copy.reference_scatter_blocks,
                        linear=invariant.reference_linear, mean_last_dim=invariant.reference_mean_last_dim,
                        rms_norm=layer_ops.reference_rms_norm, rotary=layer_ops.reference_rotary,
                        silu_and_mul=layer_ops.reference_silu_and_mul)
    elif backend == "triton":
        if not triton_available():
            raise ValueError("model.attention_backend: 'triton' needs the triton package, which is not installed "
                             "(use 'torch' or 'auto')")
        from kvstrata.kernels import batch_invariant as invariant
        from kvstrata.kernels import block_copy, kv_store, layer_ops, prefix_prefill

        ops = KernelOps(name="triton", store_kv=kv_store.store_kv, prefix_prefill=prefix_prefill.prefix_prefill,
                        gather_blocks=block_copy.gather_blocks, scatter_blocks=block_copy.scatter_blocks,
                        linear=invariant.linear, mean_last_dim=invariant.mean_last_dim,
                        rms_norm=layer_ops.rms_norm, rotary=layer_ops.rotary, silu_and_mul=layer_ops.silu_and_mul)
    else:
        raise ValueError(f"model.attention_backend: unknown backend {backend!r} (expected one of {_CHOICES})")
    if batch_invariant:
        # Backend "cpu": attention, products and layer ops are compiled kernels invariant by themselves, and a CPU
        # mean over the last axis is already the invariant one, so the mode only sends the products to `linear`
        # (a torch function mode intercepting every call of a step cost a large share of a decode step there).
        by_itself = ops.name == "cpu"
        ops = dataclasses.replace(ops, batch_invariant=True, model_linear=ops.linear if by_itself else None,
                                  intercept=not by_itself,
                                  prefix_prefill=functools.partial(ops.prefix_prefill, batch_invariant=True))
    return ops


# Where `model.batch_invariant: auto` turns the mode on: backends and CPU families where it was measured to cost
# about the default's time (backend "cpu" on AVX2, float32 and bfloat16, its products and layer ops being compiled
# kernels invariant by themselves). AVX-512 and AMX CPUs (torch's oneDNN products are faster there) and GPUs were
# not measured: off.
INVARIANT_BY_DEFAULT = {("cpu", "avx2")}


def resolve_batch_invariant(setting: bool | str, backend: str) -> bool:
    """`model.batch_invariant` with `auto` resolved for the resolved `backend` on the host (see
    `INVARIANT_BY_DEFAULT`; `KVSTRATA_CPU_AMX` is honoured, as for the dtype)."""
    if setting != "auto":
        return bool(setting)
    if backend != "cpu":
        return False
    from kvstrata.kernels import cpu_features

    return (backend, cpu_features.cpu_matrix_family()) in INVARIANT_BY_DEFAULT


def compiled_products(backend: str, dtype: torch.dtype, batch_invariant: bool) -> bool:
    """Whether the model's products in `dtype` are backend "cpu"'s compiled kernel (kernels/cpu_linear.py) rather
    than torch's: always in the invariant mode, and in the default mode for the dtypes it is faster in here."""
    if backend != "cpu":
        return False
    from kvstrata.kernels import cpu_linear

    return cpu_linear.available() and (batch_invariant or cpu_linear.takes_default_products(dtype))


def device_problem(backend: str, device_type: str) -> str | None:
    """Why the configured `model.attention_backend` cannot run on a `device_type` ("cpu" or "cuda") device, or None:
    what config validation can tell before any kernel is built ("triton" off CUDA unless the Triton interpreter is
    on; "cpu" off a CPU)."""
    if backend == "cpu" and device_type != "cpu":
        return f"model.attention_backend: 'cpu' runs on a CPU device, got {device_type!r} (use 'auto')"
    if backend == "triton" and device_type != "cuda" and not triton_interpreted():
        return f"model.attention_backend: 'triton' needs a CUDA device, got {device_type!r} (use 'torch' or 'auto')"
    return None


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn the configured `model.attention_backend` into a concrete backend for `device`:
    "auto" is "triton" on CUDA when Triton imports, "cpu" on a CPU when its kernel builds, else "torch";
    `device_problem`'s cases are errors, and so are "triton" without the triton package and "cpu" where its kernel
    cannot be built; "torch" works everywhere."""
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    if backend == "auto":
        if device_type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device_type == "cpu" and cpu_kernel_available() else "torch"
    if backend == "torch":
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"model.attention_backend: unknown backend {backend!r} (expected one of {_CHOICES})")
    problem = device_problem(backend, device_type)
    if problem is not None:
        raise ValueError(problem)
    if backend == "cpu" and not cpu_kernel_available():
        raise ValueError(_NO_CPU_KERNEL)
    if backend == "triton" and not triton_available():
        raise ValueError("model.attention_backend: 'triton' needs the triton package, which is not installed "
                         "(use 'torch' or 'auto')")
    return backend


__all__ = ["BACKENDS", "INVARIANT_BY_DEFAULT", "KernelOps", "compiled_products", "cpu_kernel_available",
           "device_problem", "get_ops", "resolve_batch_invariant", "resolve_backend", "triton_available",
           "triton_interpreted"]
