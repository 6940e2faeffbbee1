"""Batch-invariant mode (`model.batch_invariant: true`): route a model's row reductions to kernels whose bits do
not depend on the batch, for the duration of one forward pass.

The decoder (engine/decoder.py) computes its products with `F.linear`, and on the torch path RMSNorm with a mean
over the last axis (the Triton RMSNorm reduces each row in a program of its own, invariant as it is); every other
op of a Llama-family layer is elementwise or a gather, which gives a row the same bits whatever shares the call.
Attention is ours already (`ops.prefix_prefill`, which the mode's ops make invariant). A torch function mode
intercepts exactly those two calls on the thread running the forward pass, so other engines in the process are
unaffected.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MEANS = (torch.Tensor.mean, torch.mean)


class BatchInvariantMode(TorchFunctionMode):
    """Within `with BatchInvariantMode(ops):`, `F.linear` runs `ops.linear` and a float mean over the last axis
    runs `ops.mean_last_dim`; everything else runs as usual."""

    def __init__(self, ops) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.ops.linear(*args, **kwargs)
        if func in _MEANS and _is_last_dim_mean(*args, **kwargs):
            return self.ops.mean_last_dim(args[0], keepdim=kwargs.get("keepdim", args[2] if len(args) > 2 else False))
        return func(*args, **kwargs)


def _is_last_dim_mean(x, dim=None, keepdim=False, *, dtype=None) -> bool:
    if dtype is not None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return False
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return dim is not None and dim % x.dim() == x.dim() - 1
