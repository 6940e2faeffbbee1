"""KVCacheManager: a request's view of the tiered cache (vLLM v1 names).

The scheduler asks it three things: how much of a request's prefix is cached anywhere
(`get_computed_blocks`, which starts loading lower-tier hits to the device and answers None while
they load), for device slots for the tokens it is about to compute (`allocate_slots`), and to let a
request go (`free`). How much of a prefix found below the device is worth loading rather than
recomputing is `cache.load_policy`'s choice (engine/load_policy.py), from the measured speeds kept here.

A request's prefix is held from its lookup until it is admitted or let go: device hits by their
ref count, lower-tier hits in their tier and by the device blocks they are being copied into.

A request that loads holds device blocks while it is not running, where preemption cannot take them
back. So that concurrent loads can never take the room each other's prefill needs (and evict each
other's landed prefixes, for ever), a load starts only when the device can hold the request's whole
prompt, and the blocks for the rest of its prompt are reserved with it: once landed, its prefill
always completes. A request whose load finds no such room stays waiting and is looked up again later.

When the load policy overlaps (engine/load_policy.py), the request is admitted at once with its device
hits, computes the head of its lower-tier run as an ordinary prefill up to a barrier (`barrier`), while
the tail after it loads; once both are done, `land_tail` appends the tail's blocks and its computed
tokens jump over them.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Sequence

from kvstrata.engine.costs import ReadCost, StepCost
from kvstrata.engine.hashing import BlockHasher
from kvstrata.engine.load_policy import LOAD_POLICIES, LoadPlan, choose_plan, recomputed_by_tier
from kvstrata.engine.prompt_logprobs import PromptLogprobCache
from kvstrata.engine.request import Request
from kvstrata.tiers.base import TIER_NAMES
from kvstrata.tiers.block_pool import KVCacheBlock
from kvstrata.tiers.hierarchy import PrefixHit, PrefixLoad, TierHierarchy

ComputedBlocks = tuple[list[KVCacheBlock], int, dict[str, int]]
# How long what the lower tiers hold of a waiting request is taken as known: for ordering it
# (`_locate_waiting`), and for trying it again while the device has no room for it (`is_refused`).
LOWER_LOOKUP_REFRESH_S = 1.0


@dataclass
class Refusal:
    """A waiting request the device had no room for, and what its next try needs to have changed."""
    at: float            # time.monotonic() of the refusal
    free_blocks: int     # the device pool's free blocks then
    on_device: bytes     # per block of its prefix, whether the device held it then (1) or not (0)


@dataclass
class Tail:
    """Blocks `start..` of a request's prefix, loading while the request computes the blocks before them."""

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


@dataclass
class PrefixCacheStats:
    """The prefix cache's hit counters: one definition, counted once per request at its first
    admission (what the request reports as `cached_tokens_by_tier`), so an admission retried
    because the device was full, or after a preemption, is not counted again. A tail loading beside
    the prefix counts when it lands (`KVCacheManager.record_admission`)."""

    queries: int = 0                 # requests admitted
    query_tokens: int = 0            # their prompt tokens
    query_blocks: int = 0            # their blocks that could hit (full blocks before the last prompt token)
    hit_blocks: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})  # served, per tier
    # found in each tier at lookup but recomputed, by the load policy's choice (`recomputed_tokens_by_tier`)
    recomputed_blocks: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})


class KVCacheManager:
    def __init__(self, hierarchy: TierHierarchy, hasher: BlockHasher, block_size: int,
                 enable_caching: bool = True, load_policy: str = "auto",
                 prompt_logprobs: PromptLogprobCache | None = None):
        if load_policy not in LOAD_POLICIES:
            raise ValueError(f"cache.load_policy: unknown policy {load_policy!r} (use one of {', '.join(LOAD_POLICIES)})")
        self.load_policy = load_policy
        self.hierarchy = hierarchy
        self.pool = hierarchy.pool
        self.hasher = hasher
        self.block_size = block_size
        self.enable_caching = enable_caching
        # request_id -> the device blocks it holds, in position order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, tuple[list[KVCacheBlock], array]] = {}  # see `get_block_ids`
        self._lower_lookups: dict[str, tuple[float, list[str]]] = {}  # see `_locate_waiting`
        self._refusals: dict[str, Refusal] = {}  # see `is_refused`
        # request_id -> how many of its blocks are cached (hashed into the device map) so far.
        self.num_cached_block: dict[str, int] = {}
        # request_id -> its prefix from lookup until the scheduler takes it (loading or landed).
        self.prefix_loads: dict[str, PrefixLoad] = {}
        # Prefixes of requests let go while their load was in flight: released once it lands.
        self._abandoned: list[PrefixLoad] = []
        # request_id -> fresh device blocks reserved, at the start of its load, for the rest of its prompt.
        self.reserved: dict[str, list[KVCacheBlock]] = {}
        # request_id -> the tail of its prefix, loading while the request computes the head before it.
        self.tails: dict[str, Tail] = {}
        # request_id -> per block of the prefix last handed to the scheduler, the tier that served it
        # (its hits are counted when the request is admitted with it: `record_admission`).
        self._prefix_tiers: dict[str, list[str]] = {}
        self.prefix_stats = PrefixCacheStats()
        # Prompt log-probabilities by block: a request asking for them may use a cached prefix only as
        # far as their entries are known (engine/prompt_logprobs.py).
        self.prompt_logprobs = PromptLogprobCache(0, block_size) if prompt_logprobs is None else prompt_logprobs
        # Measured speeds (engine/costs.py): each lower tier's loads, and the engine's steps (reported
        # through the scheduler, which prices waiting work with the same estimates).
        block_nbytes = hierarchy.kv_cache[0].numel() * hierarchy.kv_cache.element_size()
        self.read_costs: dict[str, ReadCost] = {t: ReadCost(block_nbytes) for t in TIER_NAMES if t != "device"}
        self.step_cost = StepCost()
        # A head computed while its tail loads is counted on to run beside the load on a CPU, not on a GPU
        # (engine/load_policy.py).
        self.heads_overlap_loads = hierarchy.kv_cache.device.type != "cuda"

    # ----------------------------------------------------------------- hashing

    def _update_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (prompt and output tokens alike)."""
        if not self.enable_caching:
            return
        if not request.block_hashes:
            request.block_hashes = self.hasher.hash(request.all_token_ids, cache_salt=request.cache_salt)
        elif request.num_tokens >= (len(request.block_hashes) + 1) * self.block_size:  # a block became full
            self.hasher.extend(request.block_hashes, request.all_token_ids, cache_salt=request.cache_salt)

    def _block_tokens(self, request: Request, start: int, stop: int) -> list[tuple[int, ...]]:
        """The token ids of blocks `start .. stop - 1`, a tuple each: the form the tiers keep and compare."""
        bs = self.block_size
        ids = request.token_ids(start * bs, stop * bs)  # full blocks only: the ones a chain hash names
        return list(zip(*[iter(ids)] * bs))  # each block's tuple made in C: 437 a document

    # ----------------------------------------------------------------- the scheduler's calls

    def get_computed_blocks(self, request: Request) -> ComputedBlocks | None:
        """The longest cached prefix of the request in any tier, held on the device, or None while
        the part found below the device is loading (`holds_prefix`: ask again once it lands) or has
        no room to load into yet (nothing held: ask again when requests have finished). Moves the
        request into its lookup phase, then its load phase if there is a load (engine/receipt.py).

        Returns (blocks, num_computed_tokens, tokens per tier). The hit is capped so that at least
        the last token is computed (its logits are needed), and, for a request asking for its
        prompt's logprobs, where its entries stop (`_prefix_hashes`). The blocks are ref-counted for
        the request: pass them to `allocate_slots`, which keeps or releases them.
        """
        if not self.enable_caching:
            return [], 0, {t: 0 for t in TIER_NAMES}
        if not self.start_prefix(request):
            return None
        load = self.prefix_loads[request.request_id]
        if not load.ready:
            return None
        hit = self._finish_load(load)
        self._account_load(request, load)
        self._prefix_tiers[request.request_id] = hit.tiers
        del self.prefix_loads[request.request_id]  # last: a fault before leaves the prefix held for `free` to let go
        by_tier = {t: n * self.block_size for t, n in hit.blocks_by_tier.items()}
        return hit.blocks, hit.num_blocks * self.block_size, by_tier

    def start_prefix(self, request: Request, refuse: bool = True) -> bool:
        """Whether the request holds its prefix (`holds_prefix`): if it does not yet, look it up, hold it and start
        its load (`get_computed_blocks` then finishes it). False: the device has no room for its prompt now;
        `refuse=False` does not remember that (`is_refused`), for a caller asking before requests have finished."""
        if request.request_id in self.prefix_loads:
            return True
        if self.is_refused(request):
            return False
        request.enter_phase("lookup")
        if self._start_prefix(request, refuse) is None:
            request.enter_phase("queue")
            return False
        return True

    def finish_landed_loads(self) -> None:
        """Finish every load that has landed (`TierHierarchy.finish_prefix`: its blocks cached on the device,
        its lower-tier holds let go), before its request is admitted or its tail joins it. The engine calls
        this while the device computes a step: on a GPU, the host work of caching a 7k-token document's 443
        blocks was 1.7 ms of the next step's, on the path of every sequence decoding beside it."""
        if not self.prefix_loads and not self.tails:
            return  # (every decode step asks)
        for load in [*self.prefix_loads.values(), *(tail.load for tail in self.tails.values())]:
            if load.hit is None and load.ready:
                self._finish_load(load)

    def _finish_load(self, load: PrefixLoad) -> PrefixHit:
        """`finish_prefix`, its load timed once (pricing later loads)."""
        if load.hit is None:
            self.hierarchy.finish_prefix(load)
            self._measure_load(load)
        return load.hit

    def _start_prefix(self, request: Request, refuse: bool = True) -> PrefixLoad | None:
        """Look the request up, plan what to load (`cache.load_policy`), hold it and start loading; None
        (and nothing held) when the device has no room for the request's prompt now."""
        hashes = self._prefix_hashes(request)
        found_in = self._admission_lookup(request, hashes)
        plan = self._choose_plan(request, found_in)
        # blocks to compute: the head (while the tail loads) and the prompt after the cut
        fresh = plan.head_end - plan.device_run + -(-request.num_tokens // self.block_size) - plan.cut
        used = [*range(plan.device_run), *range(plan.head_end, plan.cut)]
        # a load, or a head computed before its tail (which may be all on the device), reserves the rest
        reserves = plan.overlaps or any(found_in[k] != "device" for k in used)
        if reserves and not self._room_for_load([hashes[k] for k in used], [found_in[k] for k in used], fresh):
            if refuse:
                self._refuse(request)
            return None
        if request.cached_tokens_by_tier is None:  # not admitted yet: what it will report, and be counted
            request.recomputed_tokens_by_tier = recomputed_by_tier(found_in, plan, self.block_size, TIER_NAMES)
            request.tail_to_count = range(plan.head_end, plan.cut) if plan.overlaps else None
        elif request.tail_to_count is not None:  # a retry settles what the first admission's tail left
            request.tail_recomputed = recomputed_by_tier(found_in, plan, self.block_size, TIER_NAMES,
                                                         within=request.tail_to_count)
        first = plan.device_run if plan.overlaps else plan.cut  # the prefix the request starts from
        # the tokens of the blocks that load (the device's hits are not read: a document's 443 tuples were
        # made for nothing at every admission)
        tokens = [None] * plan.device_run + self._block_tokens(request, plan.device_run, first)
        load = self.hierarchy.acquire_prefix(hashes[:first], tokens, found_in[:first])
        self.prefix_loads[request.request_id] = load
        if plan.overlaps:  # the tail loads while the request computes the head
            tail = self.hierarchy.acquire_prefix(hashes[plan.head_end:plan.cut],
                                                 self._block_tokens(request, plan.head_end, plan.cut),
                                                 found_in[plan.head_end:plan.cut], parent=hashes[plan.head_end - 1])
            self.tails[request.request_id] = Tail(tail, plan.head_end, plan.cut)
        if reserves:
            self.reserved[request.request_id] = self.pool.get_new_blocks(fresh)
        if load.transfer is not None:  # submitted: the load phase starts, landed or not
            self._enter_load_phase(request, load)
        return load

    @staticmethod
    def _enter_load_phase(request: Request, load: PrefixLoad) -> None:
        """The request waits for `load`: until it lands (and its reads' times split the phase among the
        tiers), the phase is split by the blocks it reads from each tier, which is what a request let go
        before its load lands (a preempted one waiting for its tail) is told."""
        request.enter_phase("load")
        request.phases.load_split = _found_below(load)

    def _account_load(self, request: Request, load: PrefixLoad) -> None:
        """A landed load splits the request's load phase among the tiers that served it by the worker's read
        time for each (a tier asked first that held none of them adds to the others' share); if none served,
        by the blocks the walk found in each."""
        if load.transfer is not None:
            served = {t for t in load.served_from if t is not None}
            read_s = {t: s for t, s in load.read_s.items() if t in served and s > 0}
            request.phases.load_split = read_s or _found_below(load)

    # ----------------------------------------------------------------- a tail loading while the head computes

    def barrier(self, request: Request) -> int | None:
        """The token the request's computing must stop at until its tail has landed (None: no tail)."""
        tail = self.tails.get(request.request_id)
        return None if tail is None else tail.start * self.block_size

    def wait_for_tail(self, request: Request) -> None:
        """The request has computed its head and waits for its tail: its load phase."""
        self._enter_load_phase(request, self.tails[request.request_id].load)

    def tail_ready(self, request: Request) -> bool:
        tail = self.tails.get(request.request_id)
        return tail is not None and tail.load.ready

    def land_tail(self, request: Request) -> None:
        """The head is computed and the tail has landed: its blocks follow the head's, and the request's
        computed tokens jump over them (to where the tail ends, or to its first block not served)."""
        tail = self.tails[request.request_id]
        hit = self._finish_load(tail.load)
        self._account_load(request, tail.load)
        blocks = self.req_to_blocks[request.request_id]
        assert len(blocks) == tail.start and request.num_computed_tokens == tail.start * self.block_size
        del self.tails[request.request_id]  # only now: a fault before leaves the tail held for `free` to let go
        blocks.extend(hit.blocks)
        self.num_cached_block[request.request_id] = tail.start + hit.num_blocks
        request.num_computed_tokens += hit.num_blocks * self.block_size
        request.prefill_saved_s_estimate += self.step_cost.prefill_s(hit.num_blocks * self.block_size,
                                                                     tail.start * self.block_size)
        self._count_tail(request, hit.tiers, tail.start)
        request.tail_to_count = None  # landed: what did not arrive, the request computes

    def _count_tail(self, request: Request, tiers: list[str], start: int) -> None:
        """Count the hits among blocks `start..` of the request (served by `tiers`) that are in its tail
        still to be counted (`Request.tail_to_count`)."""
        to_count = request.tail_to_count
        if to_count is None:
            return
        for k, tier in enumerate(tiers, start):
            if k in to_count:
                request.cached_tokens_by_tier[tier] = request.cached_tokens_by_tier.get(tier, 0) + self.block_size
                self.prefix_stats.hit_blocks[tier] += 1

    def _refuse(self, request: Request) -> None:
        """The device has no room for the request now: remember what would have to change for it to."""
        self._refusals[request.request_id] = Refusal(time.monotonic(), self.pool.num_free_blocks,
                                                     self._on_device(self._prefix_hashes(request)))

    def is_refused(self, request: Request) -> bool:
        """Whether the request was refused for room and nothing that could make room has happened since:
        no device block freed, no block of its prefix come to the device or left it. The scheduler tries
        the first waiting request at every step, and a full lookup may cost a round trip to a remote
        server at each; what the lower tiers hold is taken as unchanged for `LOWER_LOOKUP_REFRESH_S`."""
        refusal = self._refusals.get(request.request_id)
        if refusal is None:
            return False
        if (time.monotonic() - refusal.at < LOWER_LOOKUP_REFRESH_S and self.pool.num_free_blocks <= refusal.free_blocks
                and self._on_device(self._prefix_hashes(request)) == refusal.on_device):
            return True
        del self._refusals[request.request_id]
        return False

    def _on_device(self, hashes: list[bytes]) -> bytes:
        return bytes(block is not None for block in self.pool.get_cached_blocks(hashes))

    def _room_for_load(self, hashes: list[bytes], found_in: list[str], rest: int) -> bool:
        """Whether the blocks `hashes`, laid out as `found_in`, can start loading: the device can take
        those found below it and `rest` more, once its device hits (some now free and cached) are held."""
        below = sum(1 for t in found_in if t != "device")
        device_hits = (self.pool.get_cached_block(h) for h, t in zip(hashes, found_in) if t == "device")
        free_hits = sum(1 for b in device_hits if b is not None and b.ref_cnt == 0)
        return self.pool.num_free_blocks - free_hits >= below + rest

    def _prefix_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the blocks that may hit: full blocks before the last token (whose logits are
        needed); for a request asking for its prompt's logprobs, only as far as it has their entries
        (taken from the cache of them first), since cached K/V carry no logits."""
        self._update_hashes(request)
        num_blocks = (request.num_tokens - 1) // self.block_size
        if request.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.extend(request)
            num_blocks = min(num_blocks, len(request.prompt_logprobs) // self.block_size)
        return request.block_hashes[:num_blocks]

    def _choose_plan(self, request: Request, found_in: list[str]) -> LoadPlan:
        """What of the found prefix to use, load and recompute (`cache.load_policy`, engine/load_policy.py)."""
        return choose_plan(self.load_policy, found_in, request.num_tokens, self.block_size, self.step_cost,
                           self.read_costs, overlap=self.heads_overlap_loads)

    def _measure_load(self, load: PrefixLoad) -> None:
        """Fold a landed load into each serving tier's read cost: the job's time, shared between the
        tiers that served it in proportion to the time their reads took."""
        if load.transfer is None or load.transfer.failed:
            return
        read_s = sum(load.read_s.values())
        for tier, seconds in load.read_s.items():
            served = sum(1 for t in load.served_from if t == tier)
            if served and read_s > 0:
                self.read_costs[tier].observe(served, load.transfer.seconds * seconds / read_s)

    def probe_lower_tiers(self) -> None:
        """Seed each lower tier's read cost with a few timed loads of throwaway blocks (start-up)."""
        sizes = self._probe_sizes()
        for tier in self.hierarchy.lower_tiers:
            for num_blocks, seconds in self.hierarchy.probe_loads(tier, sizes):
                self.read_costs[tier.name].observe(num_blocks, seconds)

    def _probe_sizes(self) -> tuple[int, ...]:
        """The loads the probe times: one block and four (a latency and a per-block cost), and loads
        large enough to be read by every fill thread at once, which read at their combined rate: timed
        on small loads only, every document's load would be priced slower than it is until promotions
        taught the fit otherwise. (Sizes the tier or the device has no room for are left out.)"""
        parallel = self.hierarchy.transfers.parallel_load_blocks
        return (1, 4, parallel, 2 * parallel) if parallel > 4 else (1, 4)

    def estimate_uncached(self, request: Request) -> UncachedEstimate:
        """What a waiting request has left to compute, from a lookup that holds nothing (one
        `count_prefix` per tier) cut where the load policy would cut it: for ordering admissions,
        not for admitting."""
        return self.estimate_uncached_many([request])[0]

    def estimate_uncached_many(self, requests: Sequence[Request]) -> list[UncachedEstimate]:
        """`estimate_uncached` of each request, their lookups made together (`_locate_waiting`)."""
        to_locate = [r for r in requests if self.enable_caching and r.request_id not in self.prefix_loads]
        located = dict(zip((r.request_id for r in to_locate), self._locate_waiting(to_locate)))
        return [self._estimate(r, located.get(r.request_id)) for r in requests]

    def _estimate(self, request: Request, located: tuple[list[bytes], list[str]] | None) -> UncachedEstimate:
        """`estimate_uncached` of a request from its lookup, (its prefix's hashes, the tier of each found),
        or from its load in flight (None)."""
        load = self.prefix_loads.get(request.request_id)
        next_hash = None
        if not self.enable_caching:
            used: list[str] = []
        elif load is not None:
            used = load.found_in
        else:
            hashes, found = located
            plan = self._choose_plan(request, found)
            used = found[:plan.device_run] + found[plan.head_end:plan.cut]
            first_off_device = next((k for k, tier in enumerate(found) if tier != "device"), len(found))
            if request.needs_prompt_logprobs:  # the next block whose prompt logprobs' entries it lacks
                k = (len(request.prompt_logprobs) + 1) // self.block_size
                next_hash = request.block_hashes[k] if k < request.num_prompt_tokens // self.block_size else None
            elif first_off_device < len(hashes):
                next_hash = hashes[first_off_device]
        hit_blocks = {t: used.count(t) for t in TIER_NAMES}
        return UncachedEstimate(request.num_tokens - len(used) * self.block_size, hit_blocks, next_hash)

    def _locate_waiting(self, requests: Sequence[Request]) -> list[tuple[list[bytes], list[str]]]:
        """`hierarchy.locate` for ordering waiting requests: each one's prefix hashes and the tier of each block
        found. The scheduler orders its waiting requests at every step, and a lower tier's lookup may cost a round
        trip to a remote server: with 16 requests waiting, those lookups made each step 25x longer. So the
        device's part is read afresh every time, and the lower tiers are asked again only after
        `LOWER_LOOKUP_REFRESH_S`, for all the requests due in one `locate_many` (a burst of arrivals: one round
        trip, not one each). Their admissions start from these lookups too (`_admission_lookup`), and ordering
        from an admission's."""
        now = time.monotonic()
        hashes = [self._prefix_hashes(r) for r in requests]
        due = [k for k, r in enumerate(requests) if self._lookup_due(r.request_id, now)]
        fresh = dict(zip(due, self.hierarchy.locate_many([hashes[k] for k in due])))
        for k, found in fresh.items():
            self._lower_lookups[requests[k].request_id] = (now, found)
        relocate = self.hierarchy.relocate_on_device
        return [(h, fresh[k] if k in fresh else relocate(h, self._lower_lookups[r.request_id][1]))
                for k, (r, h) in enumerate(zip(requests, hashes))]

    def _lookup_due(self, request_id: str, now: float) -> bool:
        earlier = self._lower_lookups.get(request_id)
        return earlier is None or now - earlier[0] >= LOWER_LOOKUP_REFRESH_S

    def _admission_lookup(self, request: Request, hashes: list[bytes]) -> list[str]:
        """`hierarchy.locate` of the prefix an admission starts from. The lookup that ordered the request stands
        in for it while its lower-tier part is younger than `LOWER_LOOKUP_REFRESH_S`, its device part read again,
        unless a block it found on the device has gone since: a burst's admissions each cost a round trip to a
        remote server, which write-throughs keep busy then. A block gone from a lower tier since is a miss when
        it is read (the prefix ends there, the rest is computed); one that arrived there since is not found.
        Ordering uses the admission's lookup next, as old as the lower tiers' answers in it."""
        now = time.monotonic()
        earlier = self._lower_lookups.get(request.request_id)
        if not self._lookup_due(request.request_id, now):
            found = self.hierarchy.relocate_on_device(hashes, earlier[1])
            if len(found) >= len(earlier[1]):
                self._lower_lookups[request.request_id] = (earlier[0], found)
                return found
        found = self.hierarchy.locate(hashes)
        self._lower_lookups[request.request_id] = (now, found)
        return found

    def is_loading(self, request: Request) -> bool:
        """The request's prefix is being copied up from a lower tier."""
        load = self.prefix_loads.get(request.request_id)
        return load is not None and not load.ready

    def wait_for_loads(self, timeout: float) -> bool:
        """Wait until some prefix load lands (True) or `timeout` seconds pass: for a step with nothing
        else to do. Also releases the prefixes of requests let go while loading."""
        loads = [*self.prefix_loads.values(), *(tail.load for tail in self.tails.values())]
        transfers = [x.transfer for x in loads if x.transfer is not None]
        landed = bool(transfers) and self.hierarchy.transfers.wait_any(transfers, timeout)
        self.release_abandoned()
        return landed

    def release_abandoned(self) -> None:
        """Let go of the prefixes whose request was freed while they loaded, once they have landed."""
        still = []
        for load in self._abandoned:
            if load.ready:
                self.pool.free_blocks(list(reversed(self._finish_load(load).blocks)))
            else:
                still.append(load)
        self._abandoned = still

    def record_admission(self, request: Request, cached_tokens_by_tier: dict[str, int]) -> None:
        """Count a request's hits as it is admitted with its prefix (see `PrefixCacheStats`): at its
        first admission, the prefix (what it reports as cached); at any, the blocks of a tail planned
        at the first that had not landed by then (the request was preempted while it loaded), wherever
        this admission's prefix found them (or as recomputed, where its load policy chose so). Once per
        request, each block."""
        tiers = self._prefix_tiers.pop(request.request_id, [])
        self._lower_lookups.pop(request.request_id, None)  # admitted: no longer ordered with the waiting ones
        if request.cached_tokens_by_tier is None:
            request.cached_tokens_by_tier = dict(cached_tokens_by_tier)
            self._count_query(request)
        else:
            self._count_tail(request, tiers, 0)
            for t, n in (request.tail_recomputed or {}).items():
                request.recomputed_tokens_by_tier[t] += n
                self.prefix_stats.recomputed_blocks[t] += n // self.block_size
        request.tail_recomputed = None
        tail = self.tails.get(request.request_id)
        request.tail_to_count = _overlap(request.tail_to_count, tail and range(tail.start, tail.end))

    def _count_query(self, request: Request) -> None:
        stats = self.prefix_stats
        stats.queries += 1
        stats.query_tokens += request.num_prompt_tokens
        stats.query_blocks += (request.num_prompt_tokens - 1) // self.block_size
        recomputed = request.recomputed_tokens_by_tier or {}
        for t in TIER_NAMES:
            stats.hit_blocks[t] += request.cached_tokens_by_tier.get(t, 0) // self.block_size
            stats.recomputed_blocks[t] += recomputed.get(t, 0) // self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of the request (after its computed ones).

        `new_computed_blocks` are the prefix blocks from `get_computed_blocks` (first scheduling
        only). Returns the newly allocated blocks, or None if the device pool cannot hold them; then
        nothing changes for the request except that `new_computed_blocks` are released (they stay
        cached on the device, findable again). Blocks that will be full once this step's tokens are
        computed are cached right away, as vLLM does: in a step, every sequence's new K/V are stored
        before any attention reads them, so another request in the same step may already share them.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        reserved = self.reserved.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_needed > len(reserved) + self.pool.num_free_blocks:
            if new_computed_blocks:
                self.pool.free_blocks(list(reversed(new_computed_blocks)))
            if not blocks:  # a waiting request's admission: it is looked up again, and reserves again, later
                del self.req_to_blocks[request.request_id]
                self._release_reserved(request)  # (whatever its prefix came to: a load that failed whole has none)
                self._abandon_loads(request)
                self._refuse(request)
            return None
        blocks.extend(new_computed_blocks)
        # prefix blocks come only at a request's first scheduling, and they are all cached already
        self.num_cached_block.setdefault(request.request_id, len(new_computed_blocks))
        from_reserve = min(num_needed, len(reserved))
        # from the pool first: a fault there leaves the reserve whole, for `free` to let go
        fresh = self.pool.get_new_blocks(num_needed - from_reserve) if num_needed > from_reserve else []
        new_blocks = reserved[:from_reserve] + fresh
        del reserved[:from_reserve]
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        self._update_hashes(request)
        num_cached = self.num_cached_block[request.request_id]
        # Only tokens the request already knows are hashable (a decode step computes one it knows).
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes))
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.hierarchy.cache_blocks(blocks, request.block_hashes, self._block_tokens(request, num_cached, num_full),
                                    num_cached, num_full)
        self.num_cached_block[request.request_id] = num_full

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Forget the device cache entries of the request's blocks from the one holding token `num_tokens` on: the
        step that was to compute their K/V failed (`TierHierarchy.uncache_blocks`)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.hierarchy.uncache_blocks(blocks[num_tokens // self.block_size:])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its unique suffix is evicted before shared roots.
        A prefix still loading is released once it lands (its device blocks are being written)."""
        self._abandon_loads(request)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._lower_lookups.pop(request.request_id, None)
        self._refusals.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self._prefix_tiers.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))
        self._release_reserved(request)

    def _abandon_loads(self, request: Request) -> None:
        """Let go of the request's prefix load and tail, if any: released now if landed, else once they land."""
        tail = self.tails.pop(request.request_id, None)
        loads = [x for x in (self.prefix_loads.pop(request.request_id, None), tail and tail.load) if x is not None]
        if loads:
            self._abandoned.extend(loads)
            self.release_abandoned()

    def _release_reserved(self, request: Request) -> None:
        reserved = self.reserved.pop(request.request_id, [])
        if reserved:
            self.pool.free_blocks(reserved)

    def blocks_to_come(self, running: list[Request]) -> set[bytes]:
        """The hashes of blocks on their way to the device: the full prompt blocks these running
        requests have yet to compute (a tail loading among them), and those in flight for a waiting
        request (`blocks_loading`). A waiting request whose next block is one of them waits for it
        rather than computing or loading it a second time beside them."""
        to_come = self.blocks_loading()
        for request in running:
            to_come |= self.prompt_blocks_to_come(request)
        return to_come

    def prompt_blocks_to_come(self, request: Request) -> set[bytes]:
        """The full prompt blocks a running request has yet to compute; for one computing its prompt's
        logprobs, also those whose entries it has yet to compute (their K/V may be cached already): a
        request scoring the same prefix waits for them rather than computing them a second time."""
        first = self.num_cached_block.get(request.request_id, 0)
        if request.needs_prompt_logprobs:
            first = min(first, (len(request.prompt_logprobs) + 1) // self.block_size)
        return set(request.block_hashes[first:request.num_prompt_tokens // self.block_size])

    def blocks_loading(self) -> set[bytes]:
        """The hashes of the blocks in flight to the device for a waiting request's prefix. (A landed
        prefix's request is admitted first, which caches them on the device; a running request's tail
        is among its prompt blocks to come.)"""
        return {h for load in self.prefix_loads.values() for h in _in_flight(load)}

    def blocks_loading_for(self, request: Request) -> set[bytes]:
        """Those of `blocks_loading` that the request's own load brings up."""
        load = self.prefix_loads.get(request.request_id)
        return set() if load is None else _in_flight(load)

    def loads_in_flight(self) -> list[str]:
        """The requests whose prefix, or tail, is still being copied up."""
        return [*(rid for rid, load in self.prefix_loads.items() if not load.ready),
                *(rid for rid, tail in self.tails.items() if not tail.load.ready)]

    def holds_prefix(self, request: Request) -> bool:
        """The request has been looked up and holds its prefix (loading, or landed and not yet admitted)."""
        return request.request_id in self.prefix_loads

    def get_block_ids(self, request: Request) -> array:
        """The request's device block ids, in order, as 32-bit integers (which numpy copies as one buffer).
        A request's block list only grows while it lives (a freed request's is dropped whole), so its ids
        are kept and extended, not read again from every block at every step (a 7k-token document has 443)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return array("i")
        known = self._block_ids.get(request.request_id)
        if known is None or known[0] is not blocks:  # a new list: the request was freed and came back
            known = self._block_ids[request.request_id] = (blocks, array("i"))
        ids = known[1]
        if len(ids) < len(blocks):
            ids.extend(b.block_id for b in blocks[len(ids):])
        return ids

    def stats(self) -> PrefixCacheStats:
        s = self.prefix_stats
        return PrefixCacheStats(s.queries, s.query_tokens, s.query_blocks, dict(s.hit_blocks),
                                dict(s.recomputed_blocks))


def _found_below(load: PrefixLoad) -> dict[str, int]:
    """How many of the load's blocks the lookup found in each lower tier."""
    return {t: load.found_in.count(t) for t in set(load.found_in) - {"device"}}


def _in_flight(load: PrefixLoad) -> set[bytes]:
    return set() if load.ready else {load.block_hashes[k] for k in load.below}


def _overlap(a: range | None, b: range | None) -> range | None:
    """The blocks in both ranges (None: none)."""
    if a is None or b is None or max(a.start, b.start) >= min(a.stop, b.stop):
        return None
    return range(max(a.start, b.start), min(a.stop, b.stop))
