"""RequestKVState: everything the KV manager holds for one request, in one object.

`KVCacheManager` makes a request's state at its first lookup and drops it whole in `free` (at a
preemption, an abort or the end): nothing of a request is kept anywhere else in the manager, so a
request let go can leave nothing behind. What the request reports (its hits, counted once across
preemptions) outlives its state: it is the request's own `HitAccount` (engine/receipt.py).

Holds, in the order they are taken:

- `lookup`: what the lower tiers answered for its prefix, and when (a lookup that holds nothing,
  for ordering the waiting requests; its admission starts from it while it is fresh);
- `prefix`: its prefix from its lookup until `get_computed_blocks` hands it over: device hits held
  by their ref count, lower-tier hits held in their tier and by the device blocks they load into;
- `computed`: the prefix blocks handed over, until `allocate_slots` takes them into `blocks` (or
  lets them go);
- `reserved`: fresh device blocks set aside, when a load starts, for the rest of its prompt;
- `tail`: blocks `start..end` of its prefix, loading while it computes the blocks before them;
- `blocks`: the device blocks it owns, in position order (vLLM's `req_to_blocks` entry).

Every device block it holds is in exactly one of `prefix`, `computed`, `reserved`, `tail` and
`blocks`, each with one ref count of its own.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Mapping

from kvstrata.engine.costs import ReadCost
from kvstrata.tiers.block_pool import KVCacheBlock
from kvstrata.tiers.hierarchy import PrefixLoad


@dataclass
class Tail:
    """Blocks `start..end` of a request's prefix, loading while the request computes the blocks before them."""

    load: PrefixLoad
    start: int
    end: int


@dataclass
class UncachedEstimate:
    """A waiting request's work left after a lookup (`KVCacheManager.estimate_uncached`)."""

    tokens: int                  # tokens to compute
    hit_blocks: dict[str, int]   # cached blocks it would use, per tier
    # its first full block not on the device (None: none, or its prefix is held); for a request computing
    # its prompt's logprobs, the first whose entries it lacks
    next_hash: bytes | None
    # each lower tier's measured load speed, which prices `hit_blocks` when asked (`load_s`)
    read_costs: Mapping[str, ReadCost] = field(default_factory=dict, repr=False, compare=False)

    @property
    def load_s(self) -> float:
        """The estimated time to load its lower-tier hits, at the speeds measured now."""
        return sum(self.read_costs[t].load_s(n) for t, n in self.hit_blocks.items() if t != "device")

    @property
    def loads_below(self) -> bool:
        """It would use blocks found below the device: admitted, it would wait for a load."""
        return any(n for t, n in self.hit_blocks.items() if t != "device")


@dataclass
class Lookup:
    """The tier of each block of a request's prefix that a lookup found, when the lower tiers answered, and the
    estimate made from it for ordering (`KVCacheManager.estimate_uncached_many`)."""

    at: float             # time.monotonic() of the lower tiers' answer
    found_in: list[str]
    estimate: UncachedEstimate | None = None


@dataclass
class RequestKVState:
    request_id: str
    blocks: list[KVCacheBlock] = field(default_factory=list)
    # `blocks`' ids as 32-bit integers (which numpy copies as one buffer), extended as `blocks` grows
    block_ids: array = field(default_factory=lambda: array("i"))
    num_cached_blocks: int = 0  # of `blocks`, how many are cached (hashed into the device map) so far
    prefix: PrefixLoad | None = None
    computed: list[KVCacheBlock] | None = None
    # per block of the prefix handed over, the tier that served it (its hits count at admission)
    prefix_tiers: list[str] = field(default_factory=list)
    reserved: list[KVCacheBlock] = field(default_factory=list)
    tail: Tail | None = None
    lookup: Lookup | None = None

    @property
    def loads(self) -> list[PrefixLoad]:
        """Its prefix's load and its tail's, those it has."""
        return [x for x in (self.prefix, self.tail and self.tail.load) if x is not None]

    def loads_in_flight(self) -> bool:
        return any(not load.ready for load in self.loads)

    def block_ids_now(self) -> array:
        """`block_ids`, extended to every block it owns: a request's block list only grows while it lives (a
        freed request's state is dropped whole), so its ids are not read again from every block at every step."""
        ids = self.block_ids
        if len(ids) < len(self.blocks):
            ids.extend(b.block_id for b in self.blocks[len(ids):])
        return ids
