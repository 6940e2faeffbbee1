"""Sizing and machine checks: a tier's bytes (sizes in blocks converted with the model's block
shape), and whether each tier fits in the memory or disk that would hold it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

import psutil

from kvstrata.engine.config.fields import KV_CACHE_DTYPES, FieldError
from kvstrata.engine.config.probes import auto_dtype
from kvstrata.engine.sizes import Size, format_size
from kvstrata.kernels.backends import device_problem
from kvstrata.tiers.storage import check_room, format_bytes

if TYPE_CHECKING:
    from kvstrata.engine.config.schema import Config

_RAM = "the RAM available"


def available_ram_bytes() -> int:
    """RAM that a new allocation can have now (what other processes use is not ours to take)."""
    return psutil.virtual_memory().available


def pinned_allocation_bytes(nbytes: int) -> int:
    """What a pinned host allocation of `nbytes` really takes: torch's caching host allocator rounds
    every request up to a power of two (a 33 GiB slab pins 64 GiB)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


class TierBytes:
    """A tier size in bytes, a block count converted with the model's block size (read once, lazily:
    it needs the model's shape and the resolved dtype)."""

    def __init__(self, config: Config):
        self.config = config
        self._block_nbytes: int | None = None

    @property
    def block_nbytes(self) -> int:
        if self._block_nbytes is None:
            self._block_nbytes = self.config.model.shape().kv_block_nbytes(self.config.cache.block_size,
                                                                           _dtype_for_sizing(self.config))
        return self._block_nbytes

    def __call__(self, size: Size) -> int:
        return size.nbytes if size.is_bytes else size.to_bytes(self.block_nbytes)

    def describe(self, size: Size) -> str:
        if size.is_bytes:
            return format_size(size.nbytes)
        return f"{size.num_blocks} blocks ({format_bytes(self(size))} at {self.block_nbytes} bytes a block)"


def _dtype_for_sizing(config: Config) -> str:
    """The dtype a block will have, without importing torch where the answer does not need it:
    `auto` is 2 bytes on any GPU (bfloat16 or float16) and needs torch's CPU check only on a CPU."""
    if config.cache.kv_cache_dtype != "auto":
        return KV_CACHE_DTYPES[config.cache.kv_cache_dtype]
    if config.model.dtype != "auto":
        return config.model.dtype
    where, _ = device_capacity(config.model.device)
    return "bfloat16" if where != _RAM else auto_dtype("cpu")


def check_attention_backend(config: Config) -> None:
    """The attention backend asked for against the device the model would run on (kernels/backends.py's rules).
    Raises FieldError naming `model.attention_backend`."""
    where, _ = device_capacity(config.model.device)
    problem = device_problem(config.model.attention_backend, "cpu" if where == _RAM else "cuda")
    if problem is not None:
        key, _, message = problem.partition(": ")
        raise FieldError(key, message)


def check_tiers_fit(config: Config, disk: bool = True) -> None:
    """Every tier's bytes, whether its size was given in bytes or in blocks, against the memory or
    disk that would hold it: the device's memory; the RAM available now for the CPU tier plus a
    device tier on the CPU (pinned memory counted as the allocator rounds it); with `disk`, the
    disk's room. The device and CPU tiers must hold a block at least. Raises FieldError naming the
    tier's size key."""
    tiers = config.cache.tiers
    tier_bytes = TierBytes(config)
    where, capacity = device_capacity(config.model.device)
    for key, tier in (("cache.tiers.device.size", tiers.device), ("cache.tiers.cpu.size", tiers.cpu)):
        if tier is not None and tier_bytes(tier.size) < tier_bytes.block_nbytes:
            raise FieldError(key, f"{tier_bytes.describe(tier.size)} holds no block of {tier_bytes.block_nbytes} "
                                  "bytes")
    device_bytes = tier_bytes(tiers.device.size)
    if capacity is not None and device_bytes > capacity:
        raise FieldError("cache.tiers.device.size", f"{tier_bytes.describe(tiers.device.size)} is more than "
                                                    f"{where} ({format_bytes(capacity)})")
    if tiers.cpu is not None:
        on_gpu = where != _RAM
        ram = available_ram_bytes() - (0 if on_gpu else device_bytes)
        needed = tier_bytes(tiers.cpu.size)
        if tiers.cpu.pinned and on_gpu:
            needed = pinned_allocation_bytes(needed)
        if needed > ram:
            rounded = f" (pinned: {format_bytes(needed)} once rounded up)" if tiers.cpu.pinned and on_gpu else ""
            beside = "" if on_gpu else " beside the device tier"
            raise FieldError("cache.tiers.cpu.size", f"{tier_bytes.describe(tiers.cpu.size)}{rounded} is more than "
                                                     f"the RAM available{beside} ({format_bytes(ram)})")
    if tiers.disk is not None and disk:
        try:
            check_room(tiers.disk.path, tier_bytes(tiers.disk.size), spelled=tier_bytes.describe(tiers.disk.size))
        except ValueError as exc:
            raise FieldError("cache.tiers.disk.size", str(exc)) from None


def device_capacity(device: str) -> tuple[str, int | None]:
    """Where the device tier would live and how many bytes that memory holds (None: unknown)."""
    if device == "cpu":
        return _RAM, available_ram_bytes()
    index = int(device.partition(":")[2] or 0)
    gpu_bytes = gpu_memory_bytes(index, explicit=device != "auto")
    if device == "auto" and gpu_bytes is None:
        return _RAM, available_ram_bytes()
    return f"the memory of cuda:{index}", gpu_bytes


def gpu_memory_bytes(index: int, explicit: bool = False) -> int | None:
    """Total memory of CUDA device `index`, or None when there is no such device.

    Asks torch when it is already imported (the engine); otherwise nvidia-smi, so that validating
    a config stays cheap. Where nvidia-smi cannot answer and the config names a CUDA device
    (`explicit`), torch is asked after all: a missing device must be refused here, not at serve time.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        found = _nvidia_smi_memory_bytes(index)
        if found is not None or not explicit or shutil.which("nvidia-smi") is not None:
            return found
        import torch
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_properties(index).total_memory


def describe_cuda_devices() -> str:
    count = 0
    while gpu_memory_bytes(count) is not None:
        count += 1
    return "no CUDA device is visible" if count == 0 else f"visible: cuda:0 to cuda:{count - 1}"


def _nvidia_smi_memory_bytes(index: int) -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = str(index)
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if index >= len(ids):
            return None
        physical = ids[index]
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", physical], capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.strip().splitlines()[0]) * 1024**2  # reported in MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
