"""Small blocks for the lower-tier tests: two layouts, keys, token ids and payloads derived from an id."""
import os
import signal
import threading
import time

import torch

from kvstrata.tiers.base import BlockLayout, LowerTier, as_bytes
from kvstrata.tiers.shared_memory import shared_empty

BF16 = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
FP32 = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def payload(layout: BlockLayout, i: int) -> torch.Tensor:
    """Block `i`'s bytes: random values of the layout's dtype, the same for the same `i`."""
    g = torch.Generator().manual_seed(i)
    return as_bytes(torch.randn(layout.block_shape, generator=g).to(layout.dtype)).clone()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def tokens(i: int, layout: BlockLayout = BF16) -> list[int]:
    return [1000 * i + t for t in range(layout.block_size)]


def put_blocks(tier: LowerTier, ids, layout: BlockLayout = BF16) -> None:
    tier.put([key(i) for i in ids], [tokens(i, layout) for i in ids], [payload(layout, i) for i in ids])


def get_blocks(tier: LowerTier, ids, layout: BlockLayout = BF16, toks=None, shared: bool = False) -> list[bool]:
    """Read blocks (into shared host memory if `shared`: a tier's reader processes may read them) and check every
    served one is byte-exact; returns which were served."""
    if shared:
        dests = list(shared_empty((len(ids), layout.block_nbytes), torch.uint8))
    else:
        dests = [torch.empty(layout.block_nbytes, dtype=torch.uint8) for _ in ids]
    served = tier.get([key(i) for i in ids], toks or [tokens(i, layout) for i in ids], dests)
    for i, ok, dest in zip(ids, served, dests):
        if ok:
            assert torch.equal(dest, payload(layout, i)), f"block {i} served with wrong bytes"
    return served


def read_shared(tier: LowerTier, ids, layout: BlockLayout = BF16, toks=None) -> list[bool]:
    """`get_blocks` into shared host memory."""
    return get_blocks(tier, ids, layout, toks, shared=True)


def by_processes(tier: LowerTier) -> int:
    """Blocks the tier's reader processes have read."""
    return tier.stats().extra["blocks_read_by_processes"]


def kill_a_reader_and_read_on(tier: LowerTier, caplog) -> None:
    """`tier` holds blocks 0-3 and has one reader process: killing it costs no block (the read it missed is done in
    this process, and said in the log), and the reader started in its place reads the next."""
    assert read_shared(tier, [0]) == [True]
    (pid,) = tier._readers.pids
    os.kill(pid, signal.SIGKILL)
    assert read_shared(tier, [1, 2, 3]) == [True, True, True]  # read here, by this process
    assert f"{tier.name} tier: a reader process ended" in caplog.text
    assert read_shared(tier, [0, 1]) == [True, True]  # and by the reader started in its place
    assert by_processes(tier) == 3


class GatedTier(LowerTier):
    """A lower tier whose reads wait until `gate` is set, so a test can act while a load is in flight.

    Everything else goes straight to the wrapped tier. `fail_reads` makes reads raise instead;
    `read_s_per_block` makes every read take that much longer per block (a slow tier, for the load
    policy: a test's knob, never the engine's).
    """

    def __init__(self, inner: LowerTier):
        self.inner = inner
        self.name = inner.name
        self.layout = inner.layout
        self.gate = threading.Event()
        self.gate.set()
        self.fail_reads = False
        self.read_s_per_block = 0.0

    @property
    def on_evict(self):
        return self.inner.on_evict

    @on_evict.setter
    def on_evict(self, callback):
        self.inner.on_evict = callback

    def _read(self, num_blocks: int) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail_reads:
            raise OSError("the tier failed mid-transfer")
        time.sleep(self.read_s_per_block * num_blocks)

    def get(self, block_hashes, token_ids, dests):
        self._read(len(block_hashes))
        return self.inner.get(block_hashes, token_ids, dests)

    def lend(self, block_hashes, token_ids):
        """The CPU tier's other way to be read. A slowed tier lends nothing: its reads go through `get`,
        where the delay is per block read and the fill threads share it."""
        if self.read_s_per_block:
            return None
        self._read(len(block_hashes))
        return self.inner.lend(block_hashes, token_ids)

    def contains(self, block_hash):
        return self.inner.contains(block_hash)

    def count_prefix(self, block_hashes):
        return self.inner.count_prefix(block_hashes)

    def hold(self, block_hashes):
        self.inner.hold(block_hashes)

    def release(self, block_hashes):
        self.inner.release(block_hashes)

    def put(self, block_hashes, token_ids, srcs, parents=None):
        self.inner.put(block_hashes, token_ids, srcs, parents)

    def pin(self, owner, block_hashes, info=None):
        self.inner.pin(owner, block_hashes, info)

    def unpin(self, owner):
        return self.inner.unpin(owner)

    def pins(self):
        return self.inner.pins()

    def discard(self, block_hash):
        return self.inner.discard(block_hash)

    def clear(self):
        self.inner.clear()

    def stats(self):
        return self.inner.stats()

    def blocks(self):
        return self.inner.blocks()

    def flush(self):
        self.inner.flush()

    def close(self):
        self.inner.close()
