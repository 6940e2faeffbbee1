"""Persistence: the cached blocks the disk tier lacks, written down to it (at idle time and at close), so that a later
process on the same disk path finds what this one computed."""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import torch

from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.write_down import WriteDowns

PERSIST_BATCH_BLOCKS = 64


def write_missing_to_disk(write_downs: WriteDowns, device_blocks: Sequence[tuple[bytes, int]], cpu: LowerTier | None,
                          disk: LowerTier, max_blocks: int | None) -> int:
    """Hand the cached blocks the disk tier lacks down to it, device first (`device_blocks`: the (hash, block id) of
    those that belong below), then CPU; at most `max_blocks` (an idle server writes in small chunks, so that a new
    request never waits long behind one). Returns how many."""
    missing = itertools.islice(_blocks_missing_on_disk(write_downs, device_blocks, cpu, disk), max_blocks)
    written = 0
    # batches of a bounded size: the disk tier encodes a whole batch before queueing it
    while batch := list(itertools.islice(missing, PERSIST_BATCH_BLOCKS)):
        on_device = [(h, src) for h, _, src, _ in batch if isinstance(src, int)]
        if on_device:  # one store job: a batched copy off the device, on the transfer worker
            write_downs.store([b for _, b in on_device], [h for h, _ in on_device], [disk])
        in_host = [item for item in batch if not isinstance(item[2], int)]
        if in_host:
            hashes, tokens, payloads, parents = map(list, zip(*in_host))
            write_downs.put(disk, hashes, tokens, payloads, parents)
        written += len(batch)
    return written


def _blocks_missing_on_disk(write_downs: WriteDowns, device_blocks: Sequence[tuple[bytes, int]],
                            cpu: LowerTier | None, disk: LowerTier
                            ) -> Iterator[tuple[bytes, tuple[int, ...], int | torch.Tensor, bytes | None]]:
    """(hash, token ids, device block id or host payload, parent) of cached blocks the disk tier lacks: device first,
    then CPU. Lazy, so that a small chunk stops asking the disk tier as soon as it is full."""
    seen: set[bytes] = set()
    cached = write_downs.cached
    device = ((h, cached[b].tokens, b, cached[b].parent) for h, b in device_blocks)
    held_in_cpu = cpu.blocks() if cpu is not None else ()
    for h, t, p, parent in itertools.chain(device, held_in_cpu):
        if h not in seen and not disk.contains(h):
            seen.add(h)
            yield h, t, p, parent
