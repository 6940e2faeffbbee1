"""KVCacheManager: a request's view of the tiered cache (vLLM v1 names).

The scheduler talks to it through a few whole operations (listed in engine/scheduler.py's module
doc): how much of a request's prefix is cached anywhere (`get_computed_blocks`, which starts loading
lower-tier hits to the device and answers None while they load), device slots for the tokens it is
about to compute (`allocate_slots`, which also admits a request with its prefix and counts its hits),
and letting a request go (`free`). How much of a prefix found below the device is worth loading
rather than recomputing is `cache.load_policy`'s choice (engine/load_policy.py), from the measured
speeds kept here: each lower tier's loads and the engine's steps (`step_cost`, which the engine
reports to and the scheduler caps steps with; it has no other owner).

Everything held for one request is its `RequestKVState` (engine/kv_state.py), made at its first
lookup and dropped whole by `free`. A request's prefix is held from its lookup until it is admitted
or let go: device hits by their ref count, lower-tier hits in their tier and by the device blocks
they are being copied into.

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
from kvstrata.engine.kv_state import Lookup, RequestKVState, Tail, UncachedEstimate
from kvstrata.engine.load_policy import LOAD_POLICIES, LoadPlan, choose_plan
from kvstrata.engine.prompt_logprobs import PromptLogprobCache
from kvstrata.engine.receipt import TierBlocks, tokens_by_tier
from kvstrata.engine.request import Request
from kvstrata.tiers.base import TIER_NAMES
from kvstrata.tiers.block_pool import KVCacheBlock
from kvstrata.tiers.hierarchy import PrefixHit, PrefixLoad, TierHierarchy

ComputedBlocks = tuple[list[KVCacheBlock], int, dict[str, int]]
# How long what the lower tiers hold of a waiting request is taken as known: for ordering it
# (`estimate_uncached_many`), for admitting it (`_admission_lookup`), and for trying it again while the
# device has no room for it (`is_refused`).
LOWER_LOOKUP_REFRESH_S = 1.0


@dataclass
class Refusal:
    """A request the device had no room for, and what its next try needs to have changed."""

    request: Request
    at: float            # time.monotonic() of the refusal
    free_blocks: int     # the device pool's free blocks then
    on_device: bytes     # per block of its prefix, whether the device held it then (1) or not (0)


@dataclass
class PrefixCacheStats:
    """The prefix cache's hit counters: one definition, counted once per request at its first
    admission (what the request reports as `cached_tokens_by_tier`), so an admission retried
    because the device was full, or after a preemption, is not counted again. A tail loading beside
    the prefix counts when it lands (`KVCacheManager.land_tail`)."""

    queries: int = 0                 # requests admitted
    query_tokens: int = 0            # their prompt tokens
    query_blocks: int = 0            # their blocks that could hit (full blocks before the last prompt token)
    hit_blocks: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})  # served, per tier
    # found in each tier at lookup but recomputed, by the load policy's choice (`recomputed_tokens_by_tier`)
    recomputed_blocks: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})

    def count_query(self, num_prompt_tokens: int, block_size: int) -> None:
        """A request admitted for the first time."""
        self.queries += 1
        self.query_tokens += num_prompt_tokens
        self.query_blocks += (num_prompt_tokens - 1) // block_size

    def count(self, blocks: TierBlocks) -> None:
        for t, n in blocks.served.items():
            self.hit_blocks[t] += n
        for t, n in blocks.recomputed.items():
            self.recomputed_blocks[t] += n

    def copy(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.query_tokens, self.query_blocks, dict(self.hit_blocks),
                                dict(self.recomputed_blocks))


class KVCacheManager:
    def __init__(self, hierarchy: TierHierarchy, hasher: BlockHasher, block_size: int,
                 enable_caching: bool = True, load_policy: str = "auto",
                 prompt_logprobs: PromptLogprobCache | None = None, step_cost: StepCost | None = None):
        if load_policy not in LOAD_POLICIES:
            raise ValueError(f"cache.load_policy: unknown policy {load_policy!r} (use one of {', '.join(LOAD_POLICIES)})")
        self.load_policy = load_policy
        self.hierarchy = hierarchy
        self.pool = hierarchy.pool
        self.hasher = hasher
        self.block_size = block_size
        self.enable_caching = enable_caching
        # request_id -> everything held for it (engine/kv_state.py), from its first lookup until `free`.
        self.states: dict[str, RequestKVState] = {}
        # Prefixes of requests let go while their load was in flight: released once it lands.
        self._abandoned: list[PrefixLoad] = []
        # The last request the device had no room for, and what must change for it to fit (`is_refused`).
        self._refusal: Refusal | None = None
        self.prefix_stats = PrefixCacheStats()
        # Prompt log-probabilities by block: a request asking for them may use a cached prefix only as
        # far as their entries are known (engine/prompt_logprobs.py).
        self.prompt_logprobs = PromptLogprobCache(0, block_size) if prompt_logprobs is None else prompt_logprobs
        # Measured speeds (engine/costs.py): each lower tier's loads, and the engine's steps (which the
        # engine reports through the scheduler; the scheduler caps steps and prices waiting work with it).
        block_nbytes = hierarchy.kv_cache[0].numel() * hierarchy.kv_cache.element_size()
        self.read_costs: dict[str, ReadCost] = {t: ReadCost(block_nbytes) for t in TIER_NAMES if t != "device"}
        self.step_cost = StepCost() if step_cost is None else step_cost
        # A head computed while its tail loads is counted on to run beside the load on a CPU, not on a GPU
        # (engine/load_policy.py).
        self.heads_overlap_loads = hierarchy.kv_cache.device.type != "cuda"

    def _state(self, request: Request) -> RequestKVState:
        """The request's state, made at its first touch (the only place one is made)."""
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = RequestKVState(request.request_id)
        return state

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
        return list(zip(*[iter(ids)] * bs))  # each block's tuple made in C, not in a Python loop per block

    # ----------------------------------------------------------------- the scheduler's calls

    def get_computed_blocks(self, request: Request) -> ComputedBlocks | None:
        """The longest cached prefix of the request in any tier, held on the device, or None while
        the part found below the device is loading (`is_loading`: ask again once it lands) or has
        no room to load into yet (nothing held: ask again when requests have finished). Moves the
        request into its lookup phase, then its load phase if there is a load (engine/receipt.py).

        Returns (blocks, num_computed_tokens, tokens per tier). The hit is capped so that at least
        the last token is computed (its logits are needed), and, for a request asking for its
        prompt's logprobs, where its entries stop (`_prefix_hashes`). The blocks are ref-counted for
        the request: pass them to `allocate_slots`, which keeps or releases them (`free` does, until then).
        """
        if not self.enable_caching:
            state = self._state(request)
            state.computed, state.prefix_tiers = [], []
            return [], 0, {t: 0 for t in TIER_NAMES}
        if not self._holds_or_starts_prefix(request, refuse=True):
            return None
        state = self.states[request.request_id]
        load = state.prefix
        if not load.ready:
            return None
        hit = self._finish_load(load)
        self._account_load(request, load)
        # in one statement: a fault before leaves the prefix held for `free` to let go
        state.computed, state.prefix_tiers, state.prefix = hit.blocks, hit.tiers, None
        return hit.blocks, hit.num_blocks * self.block_size, tokens_by_tier(hit.tiers, self.block_size)

    def start_load(self, request: Request) -> bool:
        """Look the request up, hold its prefix and start its load, if it does not hold its prefix yet
        (`get_computed_blocks` then finishes it): admission work the engine has done while the device
        computes a step. False: the device has no room for its prompt now, which is not remembered as a
        refusal (`is_refused`): this asks before the step's finished requests have freed their blocks. False
        too, without a lookup, while the last request refused for room would be refused again: nothing has
        made room since, and the next step's admissions ask again."""
        if self._refusal_holds():
            return False
        return self._holds_or_starts_prefix(request, refuse=False)

    def _holds_or_starts_prefix(self, request: Request, refuse: bool) -> bool:
        state = self.states.get(request.request_id)
        if state is not None and state.prefix is not None:
            return True
        if self.is_refused(request):
            return False
        request.enter_phase("lookup")
        if self._start_prefix(request, refuse) is None:
            request.enter_phase("queue")
            return False
        return True

    def finish_landed_loads(self) -> None:
        """Let go of the prefixes of requests freed while they loaded, once landed, and finish every load that
        has landed (`TierHierarchy.finish_prefix`: its blocks cached on the device, its lower-tier holds let go)
        before its request is admitted or its tail joins it. The engine has this done while the device
        computes a step: caching a long document's landed blocks is host work on the path of every sequence
        decoding beside it."""
        self.release_abandoned()
        for state in self.states.values():
            for load in state.loads:
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
        request.hits.plan(found_in, plan, self.block_size)
        first = plan.device_run if plan.overlaps else plan.cut  # the prefix the request starts from
        # the tokens of the blocks that load (the device's hits are not read: a long document's tuples were
        # made for nothing at every admission)
        tokens = [None] * plan.device_run + self._block_tokens(request, plan.device_run, first)
        state = self._state(request)
        prompt_blocks = request.num_prompt_tokens // self.block_size  # past them: its answer, if resumed
        load = state.prefix = self.hierarchy.acquire_prefix(hashes[:first], tokens, found_in[:first],
                                                            prompt_blocks=prompt_blocks)
        if plan.overlaps:  # the tail loads while the request computes the head
            tail = self.hierarchy.acquire_prefix(hashes[plan.head_end:plan.cut],
                                                 self._block_tokens(request, plan.head_end, plan.cut),
                                                 found_in[plan.head_end:plan.cut], parent=hashes[plan.head_end - 1],
                                                 prompt_blocks=max(prompt_blocks - plan.head_end, 0))
            state.tail = Tail(tail, plan.head_end, plan.cut)
        if reserves:
            state.reserved = self.pool.get_new_blocks(fresh)
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
        state = self.states.get(request.request_id)
        return None if state is None or state.tail is None else state.tail.start * self.block_size

    def land_tail(self, request: Request) -> None:
        """For a request that has computed the head before its tail (up to its `barrier`): once the tail has
        landed, its blocks follow the head's and the request's computed tokens jump over them (to where the tail
        ends, or to its first block not served), and it is back in its prefill phase; until then it waits in its
        load phase. Nothing for any other request."""
        barrier = self.barrier(request)
        if barrier is None or request.num_computed_tokens < barrier:
            return
        tail = self.states[request.request_id].tail
        if tail.load.ready:
            self._join_tail(request)
            request.enter_phase("prefill")
        elif request.phases.phase != "load":
            self._enter_load_phase(request, tail.load)

    def _join_tail(self, request: Request) -> None:
        state = self.states[request.request_id]
        tail = state.tail
        hit = self._finish_load(tail.load)
        self._account_load(request, tail.load)
        assert len(state.blocks) == tail.start and request.num_computed_tokens == tail.start * self.block_size
        state.tail = None  # only now: a fault before leaves the tail held for `free` to let go
        state.blocks.extend(hit.blocks)
        state.num_cached_blocks = tail.start + hit.num_blocks
        request.num_computed_tokens += hit.num_blocks * self.block_size
        saved_s = self.step_cost.prefill_s(hit.num_blocks * self.block_size, tail.start * self.block_size)
        self.prefix_stats.count(request.hits.land_tail(hit.tiers, tail.start, self.block_size, saved_s))

    # ----------------------------------------------------------------- refusals for room

    def _refuse(self, request: Request) -> None:
        """The device has no room for the request now: remember what would have to change for it to."""
        self._refusal = Refusal(request, time.monotonic(), self.pool.num_free_blocks,
                                self._on_device(self._prefix_hashes(request)))

    def is_refused(self, request: Request) -> bool:
        """Whether the request was the last one refused for room and nothing that could make room has happened
        since: no device block freed, no block of its prefix come to the device or left it. The scheduler tries
        the first waiting request at every step, and a full lookup may cost a round trip to a remote server at
        each; what the lower tiers hold is taken as unchanged for `LOWER_LOOKUP_REFRESH_S`."""
        refusal = self._refusal
        if refusal is None or refusal.request.request_id != request.request_id:
            return False
        if (time.monotonic() - refusal.at < LOWER_LOOKUP_REFRESH_S and self.pool.num_free_blocks <= refusal.free_blocks
                and self._on_device(self._prefix_hashes(request)) == refusal.on_device):
            return True
        self._refusal = None
        return False

    def _refusal_holds(self) -> bool:
        """Whether the last request refused for room would be refused again now (`is_refused`). While it would,
        nothing has made room that another lookup could use: the waiting requests' earlier lookups stand."""
        return self._refusal is not None and self.is_refused(self._refusal.request)

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

    # ----------------------------------------------------------------- the load policy and its measured speeds

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

    # ----------------------------------------------------------------- lookups for ordering

    def estimate_uncached(self, request: Request) -> UncachedEstimate:
        """What a waiting request has left to compute, from a lookup that holds nothing (one
        `count_prefix` per tier) cut where the load policy would cut it: for ordering admissions,
        not for admitting."""
        return self.estimate_uncached_many([request])[0]

    def estimate_uncached_many(self, requests: Sequence[Request]) -> list[UncachedEstimate]:
        """`estimate_uncached` of each request, their lookups made together (`_locate_waiting`). While the
        last request refused for room would be refused again (`_refusal_holds`), a request's estimate from an
        earlier step stands: admissions end at that request, so only requests that arrived since, and those
        ordered before it, can start before it, and nothing has made room that a new estimate could use.
        (Looking every waiting request up again at every step made a step's host work grow with the queue
        behind a full device.) An estimate that changes meanwhile is seen once the refusal ends, within
        `LOWER_LOOKUP_REFRESH_S`."""
        if not requests:
            return []
        held = self._refusal_holds()
        estimates: dict[str, UncachedEstimate] = {}
        for r in requests:
            state = self.states.get(r.request_id)
            if held and state is not None and state.lookup is not None and state.lookup.estimate is not None:
                estimates[r.request_id] = state.lookup.estimate
        to_locate = [r for r in requests if self.enable_caching and r.request_id not in estimates
                     and not self.holds_prefix(r)]
        located = dict(zip((r.request_id for r in to_locate), self._locate_waiting(to_locate)))
        for r in requests:
            if r.request_id not in estimates:
                estimates[r.request_id] = self._estimate(r, located.get(r.request_id))
        return [estimates[r.request_id] for r in requests]

    def _estimate(self, request: Request, located: tuple[list[bytes], list[str]] | None) -> UncachedEstimate:
        """`estimate_uncached` of a request from its lookup, (its prefix's hashes, the tier of each found),
        or from its load in flight (None); kept with the lookup (see `estimate_uncached_many`)."""
        state = self.states.get(request.request_id)
        next_hash = None
        if not self.enable_caching:
            used: list[str] = []
        elif state is not None and state.prefix is not None:
            used = state.prefix.found_in
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
        estimate = UncachedEstimate(request.num_tokens - len(used) * self.block_size, hit_blocks, next_hash,
                                    self.read_costs)
        if state is not None and state.lookup is not None:
            state.lookup.estimate = estimate
        return estimate

    def _locate_waiting(self, requests: Sequence[Request]) -> list[tuple[list[bytes], list[str]]]:
        """`hierarchy.locate` for ordering waiting requests: each one's prefix hashes and the tier of each block
        found. The scheduler orders its waiting requests at every step, and a lower tier's lookup may cost a round
        trip to a remote server: with many requests waiting, asking at every step made each step many times longer.
        So the device's part is read afresh every time, and the lower tiers are asked again only after
        `LOWER_LOOKUP_REFRESH_S`, for all the requests due in one `locate_many` (a burst of arrivals: one round
        trip, not one each). Their admissions start from these lookups too (`_admission_lookup`), and ordering
        from an admission's."""
        now = time.monotonic()
        hashes = [self._prefix_hashes(r) for r in requests]
        due = [k for k, r in enumerate(requests) if self._lookup_due(r, now)]
        fresh = dict(zip(due, self.hierarchy.locate_many([hashes[k] for k in due])))
        for k, found in fresh.items():
            self._state(requests[k]).lookup = Lookup(now, found)
        relocate = self.hierarchy.relocate_on_device
        return [(h, fresh[k] if k in fresh else relocate(h, self.states[r.request_id].lookup.found_in))
                for k, (r, h) in enumerate(zip(requests, hashes))]

    def _lookup_due(self, request: Request, now: float) -> bool:
        state = self.states.get(request.request_id)
        return state is None or state.lookup is None or now - state.lookup.at >= LOWER_LOOKUP_REFRESH_S

    def _admission_lookup(self, request: Request, hashes: list[bytes]) -> list[str]:
        """`hierarchy.locate` of the prefix an admission starts from. The lookup that ordered the request stands
        in for it while its lower-tier part is younger than `LOWER_LOOKUP_REFRESH_S`, its device part read again,
        unless a block it found on the device has gone since: a burst's admissions each cost a round trip to a
        remote server, which write-throughs keep busy then. A block gone from a lower tier since is a miss when
        it is read (the prefix ends there, the rest is computed); one that arrived there since is not found.
        Ordering uses the admission's lookup next, as old as the lower tiers' answers in it."""
        now = time.monotonic()
        state = self._state(request)
        # (the estimate that ordered the request stays with its lookup: it stands while a refusal holds)
        estimate = None if state.lookup is None else state.lookup.estimate
        if not self._lookup_due(request, now):
            found = self.hierarchy.relocate_on_device(hashes, state.lookup.found_in)
            if len(found) >= len(state.lookup.found_in):
                state.lookup = Lookup(state.lookup.at, found, estimate)
                return found
        found = self.hierarchy.locate(hashes)
        state.lookup = Lookup(now, found, estimate)
        return found

    # ----------------------------------------------------------------- loads in flight

    def holds_prefix(self, request: Request) -> bool:
        """The request has been looked up and holds its prefix (loading, or landed and not yet admitted)."""
        state = self.states.get(request.request_id)
        return state is not None and state.prefix is not None

    def is_loading(self, request: Request) -> bool:
        """The request's prefix is being copied up from a lower tier: it holds a prefix whose load has not been
        finished (a load that lands counts as loading until `finish_landed_loads` or its admission finishes it, so
        that a caller told None by `get_computed_blocks` is told it loads, however soon it lands)."""
        state = self.states.get(request.request_id)
        return state is not None and state.prefix is not None and state.prefix.hit is None

    def wait_for_loads(self, timeout: float) -> bool:
        """Wait until some prefix load lands (True) or `timeout` seconds pass: for a step with nothing
        else to do. Also releases the prefixes of requests let go while loading. Those loads are waited for
        too: their blocks are the room a waiting request may need, and a step that did not wait for them
        would come straight back, spinning beside the copy it waits on."""
        loads = [x for s in self.states.values() for x in s.loads] + self._abandoned
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

    def loads_in_flight(self) -> list[str]:
        """The requests whose prefix, or tail, is still being copied up."""
        return [*(rid for rid, s in self.states.items() if s.prefix is not None and not s.prefix.ready),
                *(rid for rid, s in self.states.items() if s.tail is not None and not s.tail.load.ready)]

    def blocks_to_come(self, requests: Sequence[Request]) -> set[bytes]:
        """The hashes of blocks on their way to the device: those in flight for a waiting request's prefix
        (whose request is admitted first once they land, which caches them on the device), and, for each of
        `requests` that does not hold a prefix (a running one), the full prompt blocks it has yet to compute
        (a tail loading among them); for one computing its prompt's logprobs, also those whose entries it has
        yet to compute (their K/V may be cached already). A waiting request whose next block is one of them
        waits for it rather than computing or loading it a second time beside them."""
        to_come = {h for s in self.states.values() if s.prefix is not None for h in _in_flight(s.prefix)}
        for request in requests:
            state = self.states.get(request.request_id)
            if state is None or state.prefix is None:
                to_come |= self._prompt_blocks_to_come(request, state)
        return to_come

    def _prompt_blocks_to_come(self, request: Request, state: RequestKVState | None) -> set[bytes]:
        first = 0 if state is None else state.num_cached_blocks
        if request.needs_prompt_logprobs:
            first = min(first, (len(request.prompt_logprobs) + 1) // self.block_size)
        return set(request.block_hashes[first:request.num_prompt_tokens // self.block_size])

    # ----------------------------------------------------------------- device slots

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of the request (after its computed ones).

        `new_computed_blocks`, given only at a request's admission, are the prefix blocks from
        `get_computed_blocks` (a list, empty for a miss): once they have room, the request is admitted with
        them and its hits are counted (`_record_admission`). Returns the newly allocated blocks, or None if
        the device pool cannot hold them; then nothing changes for the request except that
        `new_computed_blocks` are released (they stay cached on the device, findable again), and a request
        not yet admitted lets go of its prefix and is remembered as refused (`is_refused`). Blocks that will
        be full once this step's tokens are computed are cached right away, as vLLM does: in a step, every
        sequence's new K/V are stored before any attention reads them, so another request in the same step
        may already share them.
        """
        admitting = new_computed_blocks is not None
        new_computed_blocks = new_computed_blocks or []
        state = self._state(request)
        blocks, reserved = state.blocks, state.reserved
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_needed > len(reserved) + self.pool.num_free_blocks:
            state.computed = None
            if new_computed_blocks:
                self.pool.free_blocks(list(reversed(new_computed_blocks)))
            if not blocks:  # a waiting request's admission: it is looked up again, and reserves again, later
                self._release_reserved(state)  # (whatever its prefix came to: a load that failed whole has none)
                self._abandon_loads(state)
                self._refuse(request)
            return None
        if not blocks:  # its first slots: its prefix blocks, if any, are all cached already
            state.num_cached_blocks = len(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        state.computed = None
        from_reserve = min(num_needed, len(reserved))
        # from the pool first: a fault there leaves the reserve whole, for `free` to let go
        fresh = self.pool.get_new_blocks(num_needed - from_reserve) if num_needed > from_reserve else []
        new_blocks = reserved[:from_reserve] + fresh
        del reserved[:from_reserve]
        blocks.extend(new_blocks)
        if admitting:
            self._record_admission(request, state, len(new_computed_blocks) * self.block_size)
        self._cache_full_blocks(request, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        self._update_hashes(request)
        state = self.states[request.request_id]
        num_cached = state.num_cached_blocks
        # Only tokens the request already knows are hashable (a decode step computes one it knows).
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.hierarchy.cache_blocks(state.blocks, request.block_hashes,
                                    self._block_tokens(request, num_cached, num_full), num_cached, num_full,
                                    request.num_prompt_tokens // self.block_size)
        state.num_cached_blocks = num_full

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Forget the device cache entries of the request's blocks from the one holding token `num_tokens` on: the
        step that was to compute their K/V failed (`TierHierarchy.uncache_blocks`)."""
        state = self.states.get(request.request_id)
        if state is not None:
            self.hierarchy.uncache_blocks(state.blocks[num_tokens // self.block_size:])

    def free(self, request: Request) -> None:
        """Let go of everything held for the request and drop its state: prefix blocks handed over and not
        taken, its loads (a prefix still loading is released once it lands: its device blocks are being
        written), its blocks (tail first, so its unique suffix is evicted before shared roots), its reserve."""
        state = self.states.pop(request.request_id, None)
        if self._refusal is not None and self._refusal.request.request_id == request.request_id:
            self._refusal = None
        if state is None:
            return
        if state.computed:
            self.pool.free_blocks(list(reversed(state.computed)))
            state.computed = None
        self._abandon_loads(state)
        if state.blocks:
            self.pool.free_blocks(list(reversed(state.blocks)))
        self._release_reserved(state)

    def _abandon_loads(self, state: RequestKVState) -> None:
        """Let go of the request's prefix load and tail, if any: released now if landed, else once they land."""
        loads = state.loads
        state.prefix = state.tail = None
        if loads:
            self._abandoned.extend(loads)
            self.release_abandoned()

    def _release_reserved(self, state: RequestKVState) -> None:
        reserved, state.reserved = state.reserved, []
        if reserved:
            self.pool.free_blocks(reserved)

    def get_block_ids(self, request: Request) -> array:
        """The request's device block ids, in order, as 32-bit integers (which numpy copies as one buffer)."""
        state = self.states.get(request.request_id)
        return array("i") if state is None else state.block_ids_now()

    # ----------------------------------------------------------------- hit accounting

    def _record_admission(self, request: Request, state: RequestKVState, num_cached: int) -> None:
        """Count a request's hits as it is admitted with its prefix (engine/receipt.py `HitAccount.admit`; see
        `PrefixCacheStats`): once per request, each block."""
        tiers, state.prefix_tiers = state.prefix_tiers, []
        state.lookup = None  # admitted: no longer ordered with the waiting ones
        if self._refusal is not None and self._refusal.request.request_id == request.request_id:
            self._refusal = None
        first = not request.hits.admitted
        tail = state.tail
        counted = request.hits.admit(tiers, self.block_size, self.step_cost.prefill_s(num_cached, 0),
                                     tail and range(tail.start, tail.end))
        if first:
            self.prefix_stats.count_query(request.num_prompt_tokens, self.block_size)
        self.prefix_stats.count(counted)

    def stats(self) -> PrefixCacheStats:
        return self.prefix_stats.copy()


def _found_below(load: PrefixLoad) -> dict[str, int]:
    """How many of the load's blocks the lookup found in each lower tier."""
    return {t: load.found_in.count(t) for t in set(load.found_in) - {"device"}}


def _in_flight(load: PrefixLoad) -> set[bytes]:
    return set() if load.ready else {load.block_hashes[k] for k in load.below}
