"""What every tier shares: the shape of one block, the lower-tier interface, tier statistics.

One block is one contiguous extent in every tier (docs/design.md, "KV layout"): its payload is
`[num_layers, 2, block_size, num_kv_heads, row]` of `dtype`, i.e. `BlockLayout.block_nbytes`
bytes, where a row is head_dim values (int8: followed by their scale, kernels/kv_format.py).
Lower tiers move payloads as flat uint8 tensors of exactly that many bytes, so moving a
block between tiers is one copy and a disk value is one byte string.
"""
from __future__ import annotations

import abc
import atexit
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from kvstrata.kernels.kv_format import row_width
from kvstrata.tiers.names import LOWER_TIER_NAMES, TIER_NAMES  # noqa: F401 - re-exported: the tiers' names, in order
from kvstrata.tiers.block_events import BlockEventListener, TierEvents
from kvstrata.tiers.shared_memory import shared_empty

KV_LAYOUT_VERSION = 1  # bump when the block layout changes: it is folded into every hash namespace


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, row_width(self.head_dim, str(self.dtype)))

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_nbytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu", pin_memory: bool = False,
                 shared: bool = False) -> torch.Tensor:
        """A block-major KV tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, row]`, zero-filled; in
        host memory other processes can write (tiers/shared_memory.py) if `shared` and on the host."""
        shape = (num_blocks, *self.block_shape)
        if shared and torch.device(device).type == "cpu":
            return shared_empty(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)


def token_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids in one canonical, comparable form (plain ints), whatever sequence they came in."""
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    return tuple(map(int, token_ids))  # (a loop in C: a promotion checks every block's ids)


def parents_or_unknown(parents: Sequence[bytes | None] | None, num_blocks: int) -> Sequence[bytes | None]:
    """A put's parent hashes, one per block: None (unknown) for each where the caller gave none."""
    return parents if parents is not None else [None] * num_blocks


def as_bytes(block: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of one contiguous block (no copy)."""
    assert block.is_contiguous(), "a block must be one contiguous extent"
    return block.reshape(-1).view(torch.uint8)


@dataclass
class TierStats:
    """Counters every tier reports; the engine sums them into `LLM.stats()` and `/metrics`."""

    name: str
    capacity_blocks: int = 0
    capacity_bytes: int = 0
    used_blocks: int = 0
    used_bytes: int = 0
    hits: int = 0             # blocks found and served (verified)
    misses: int = 0           # blocks asked for and not found
    puts: int = 0             # blocks written into this tier
    evictions: int = 0        # blocks pushed out by LRU to make room
    corrupt: int = 0          # blocks found but failing verification (header, checksum, tokens): dropped
    pinned_blocks: int = 0    # distinct blocks some pin keeps from eviction (held or not yet arrived)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Pin:
    """One owner's pin: the blocks it keeps from eviction and its own description of them.

    `info` is the owner's (JSON-serialisable, opaque to the tier): a tier that persists its pins
    gives it back after a restart, so the owner can describe what it pinned.
    """

    block_hashes: tuple[bytes, ...]
    info: dict = field(default_factory=dict)


class LowerTier(abc.ABC):
    """The interface of every tier below the device pool (CPU, disk, remote).

    Keys are chain hashes (bytes). A value is one block's payload plus the block's token ids,
    which are checked on every read: a hit is served only if the stored token ids equal the
    expected ones (and, where the tier keeps one, the checksum verifies); otherwise it is a miss,
    counted in `corrupt`, and the entry is dropped. Methods are batched: the hierarchy moves
    many blocks per call.

    A tier reports what it stores, evicts, drops and clears to `event_listener` (set by the
    hierarchy; None, the default, means no event is built at all): see tiers/block_events.py.
    """

    name: str
    layout: BlockLayout
    event_listener: BlockEventListener | None = None
    # False for a tier whose eviction is not its own to suspend (remote: the server's policy): its pins
    # are only remembered, so it neither keeps a pinned document nor limits how much may be pinned.
    keeps_pins: bool = True

    def report_contents(self) -> None:
        """Report every block held now as stored, to a listener just attached. Only a tier that outlives its
        process has anything to report (the disk tier); the others start empty, or are shared by every
        replica (remote), so a router gains nothing from hearing what they hold."""

    def _events(self) -> TierEvents | None:
        """A collector for one operation's events, or None when nobody listens."""
        return None if self.event_listener is None else TierEvents(self.name, self.layout.block_size)

    @abc.abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """True if the tier holds the block now (cheap; no verification, no LRU update)."""

    def held(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """`contains` for each hash, anywhere in the chain (not only a prefix); a tier whose lookups
        cost a round trip answers them all in one."""
        return [self.contains(h) for h in block_hashes]

    @abc.abstractmethod
    def count_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes of a chain this tier holds (stops at the first it lacks), in one
        lock or read transaction: a lookup asks each tier once per run, not once per hash."""

    def count_prefixes(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """`count_prefix` of each chain; a tier whose lookups cost a round trip asks them all in one."""
        return [self.count_prefix(chain) for chain in chains]

    def hold(self, block_hashes: Sequence[bytes]) -> None:
        """Keep these blocks from LRU eviction until `release` (a promotion will read them soon).

        Holds nest (a count per hash). A tier whose eviction is shared with other processes (disk)
        cannot promise this and keeps the default no-op: a held block that is gone when it is read
        is a miss, and the prefix ends there.
        """

    def release(self, block_hashes: Sequence[bytes]) -> None:
        """Undo one `hold` of each hash."""

    # Pins are the mechanism of pinned documents: which blocks may be pinned, and how many, is the
    # caller's policy. A pinned block is never evicted by LRU; it still leaves on `discard` (it
    # failed verification) and `clear`. Pins are per owner, so blocks shared by two owners stay
    # pinned until both let go; pinning a hash the tier does not hold yet pins it once it arrives.

    @abc.abstractmethod
    def pin(self, owner: str, block_hashes: Sequence[bytes], info: dict | None = None) -> None:
        """Keep these blocks from eviction until `unpin(owner)`. Pinning an owner again replaces its pin."""

    @abc.abstractmethod
    def unpin(self, owner: str) -> bool:
        """Drop the owner's pin (its blocks become ordinary LRU blocks); True if it had one."""

    @abc.abstractmethod
    def pins(self) -> dict[str, Pin]:
        """Every owner's pin, as of now (a persistent tier: including those made before a restart)."""

    @abc.abstractmethod
    def get(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            dests: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each block's payload into `dests[i]` (flat uint8, `layout.block_nbytes` long).

        Returns, per block, whether it was served. A False leaves `dests[i]` undefined. Served
        blocks become most recently used.
        """

    @abc.abstractmethod
    def put(self, block_hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]],
            srcs: Sequence[torch.Tensor], parents: Sequence[bytes | None] | None = None) -> None:
        """Store blocks (flat uint8 payloads). The payloads are copied before this returns, so the
        caller may overwrite `srcs` right after. A hash already held is only touched. Makes room
        by LRU eviction; never fails because the tier is full. `parents`: each block's parent hash
        where the caller knows it (None: unknown), for the BlockStored events only."""

    @abc.abstractmethod
    def discard(self, block_hash: bytes) -> bool:
        """Drop one block if held; True if it was."""

    def discard_many(self, block_hashes: Sequence[bytes]) -> int:
        """Drop each block held; how many were. A tier that commits its writes overrides it to commit once."""
        return sum(self.discard(h) for h in block_hashes)

    @abc.abstractmethod
    def clear(self) -> bool:
        """Drop every block and every pin. True once they are gone; False if the tier could not do it
        (a remote server that is down, a disk write that failed): it may keep them."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        ...

    def blocks(self) -> Iterator[tuple[bytes, tuple[int, ...], torch.Tensor, bytes | None]]:
        """Every block held, as (hash, token ids, flat uint8 payload, parent hash or None), for writing a
        tier down whole.

        A payload may be a view valid only until the next call into the tier: copy it before then.
        """
        raise NotImplementedError(f"the {self.name} tier cannot list its blocks")

    def flush(self) -> None:
        """Wait until every accepted put is durable / visible to other readers (no-op by default)."""

    def close(self) -> None:
        """Flush and release resources."""
        self.flush()


def close_at_exit(closable, method: str = "close", *args) -> Callable[[], None]:
    """Call `closable.<method>(*args)` at interpreter exit if it is still alive then, without keeping it alive;
    returns the registered function, for `atexit.unregister` once it is closed. Exit handlers run last registered
    first, so a whole registered after its parts closes before them (the hierarchy, which still writes blocks down
    into its tiers, before the disk tier)."""
    ref = weakref.ref(closable)

    def close() -> None:
        alive = ref()
        if alive is not None:
            getattr(alive, method)(*args)

    atexit.register(close)
    return close
