"""Host memory that other processes can write: the disk tier's reader processes (tiers/disk_reader.py)
copy verified blocks straight into it, with no further copy in this process.

A segment is an anonymous memory file (memfd: not bounded by /dev/shm's size, gone once nobody maps it);
its descriptor goes to a reader over a Unix socket. `locate` tells whether a tensor lies inside a live
segment, and where, so that a tier's `get` keeps its signature (destination tensors) and chooses per call
whether its reads may run in another process. A segment lives as long as any tensor made from it.

Mechanism only: who allocates shared memory, and for what, is the engine's and the transfer engine's choice.
"""
from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Place:
    """Where a tensor's bytes lie: `offset` bytes into segment `segment`."""
    segment: int
    offset: int


@dataclass(frozen=True)
class _Segment:
    id: int
    fd: int
    base: int      # the address it is mapped at in this process
    nbytes: int
    mapping: "weakref.ReferenceType[mmap.mmap]"


_lock = threading.Lock()
_ids = itertools.count(1)
_segments: dict[int, _Segment] = {}
_bases: list[tuple[int, int]] = []  # (base, id), sorted: `locate` bisects it


def shared_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `shape` and `dtype` in a new segment, zero-filled (the kernel's pages are zero)."""
    nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    fd = os.memfd_create("kvstrata-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive as long as any view of it
    segment_id = next(_ids)
    segment = _Segment(segment_id, fd, flat.data_ptr(), nbytes, weakref.ref(mapping, lambda _: _forget(segment_id)))
    with _lock:
        _segments[segment_id] = segment
        bisect.insort(_bases, (segment.base, segment_id))
    return flat.view(dtype).view(shape)


def _forget(segment_id: int) -> None:
    """The segment's mapping is gone (no tensor of it is left): its descriptor goes too."""
    with _lock:
        segment = _segments.pop(segment_id, None)
        if segment is None:
            return
        _bases.remove((segment.base, segment_id))
    os.close(segment.fd)


def locate(tensor: torch.Tensor) -> Place | None:
    """Where `tensor`'s bytes lie in a live segment, or None (another device, not contiguous, or private memory)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        k = bisect.bisect_right(_bases, (start, float("inf"))) - 1
        if k < 0:
            return None
        segment = _segments[_bases[k][1]]
    if end > segment.base + segment.nbytes:
        return None
    return Place(segment.id, start - segment.base)


def segment_fd(segment_id: int) -> int | None:
    """The descriptor of a live segment (to send to another process), or None once it is gone."""
    with _lock:
        segment = _segments.get(segment_id)
        return None if segment is None else segment.fd


def is_live(segment_id: int) -> bool:
    with _lock:
        return segment_id in _segments


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock a shared tensor for asynchronous copies to and from CUDA devices (as `pin_memory` does to
    memory of its own); False if CUDA refuses. `unpin` it before its last view goes."""
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    return int(getattr(error, "value", error)) == 0  # cudaSuccess


def unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
