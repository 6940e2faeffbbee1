"""`kvstrata plan`: size the tiers from a trace of real traffic before buying the memory.

A Mooncake-format trace (kvstrata/trace.py) is replayed, in arrival order, through the cache's own policy
code with the block payloads left out: the device `BlockPool` (prefix caching, lazy LRU, tail-first
freeing), the tier policy `TierHierarchy` asks (`tiers/policy.py`: the lookup walk, the write-down policy,
`write_through` or `on_evict`, CPU evictions cascading to disk, disk and remote hits copied up into the CPU
tier), the lower tiers' LRU order (`tiers/lru.py`, the victim choice the CPU tier evicts by) and the load
policy's choice of what to load and what to recompute (`engine/load_policy.py`). No model, no tensor, no
disk write.

How the trace becomes requests: each trace id stands for `trace_block_tokens` tokens, i.e.
`trace_block_tokens / block_size` device blocks whose chain hashes are derived from the id (an id names
its whole prefix, as a chain hash does). A request's prompt is its `input_length` tokens (held within its
ids' span); its last token is always computed, as in serving. A running request holds its prompt's and
its answer's blocks until it is done: its projected prefill, then `output_length` tokens at the profile's
decode speed; a request that finds too few free device blocks waits for running ones to finish. The answer's
full blocks are cached on the device under hashes of their own (a trace never asks an answer again) and written
down as the policy says (`cache.offload_answers`).

What the replay projects, per request, is the time to first token: the wait for device room, if any, then
the load policy's estimate of its plan (the head's compute beside the tail's load, then the rest), from speeds
measured on the serving machine (`kvstrata plan --measure` writes them) or, without a profile, stated
defaults. It does not model sharing steps with other running requests (their decodes and prefills).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvstrata.arguments import positive_int
from kvstrata.engine.costs import ReadCost, StepCost
from kvstrata.engine.load_policy import LoadPlan, choose_plan
from kvstrata.engine.sizes import Size
from kvstrata.tiers.names import LOWER_TIER_NAMES, TIER_NAMES
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.lru import LruIndex
from kvstrata.tiers.policy import TierPolicy
from kvstrata.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_trace

ROUTES = ("round_robin", "prefix")
PROFILE_VERSION = 1


# ------------------------------------------------------------------------------------------ speeds

@dataclass
class Speeds:
    """The cost model's coefficients (engine/costs.py) and the decode speed, as measured or assumed."""

    step: dict[str, float]                    # StepCost: overhead_s, per_token_s, per_pair_s, per_read_s
    reads: dict[str, dict[str, float]]        # tier -> ReadCost: latency_s, bytes_per_s
    decode_s_per_token: float
    source: str                               # where the figures come from, printed with every projection

    def step_cost(self) -> StepCost:
        s = self.step
        return StepCost(per_token_s=s["per_token_s"], overhead_s=s["overhead_s"], per_pair_s=s.get("per_pair_s", 0.0),
                        per_read_s=s.get("per_read_s", 0.0))

    def read_costs(self, block_nbytes: int) -> dict[str, ReadCost]:
        costs = {}
        for tier in LOWER_TIER_NAMES:
            r = self.reads.get(tier) or DEFAULT_SPEEDS.reads[tier]
            per_block = block_nbytes / r["bytes_per_s"] if r.get("bytes_per_s") else 0.0
            costs[tier] = ReadCost(block_nbytes, latency_s=r.get("latency_s", 0.0), per_block_s=per_block)
        return costs


# Assumed when no profile is given, and said so in the output: a data-centre GPU serving an 8B model (its
# prefill, step overhead and decode below), host-memory, NVMe and network reads at typical speeds. A profile
# measured on the serving machine replaces every figure.
DEFAULT_SPEEDS = Speeds(
    step={"overhead_s": 5e-3, "per_token_s": 1e-4, "per_pair_s": 0.0, "per_read_s": 0.0},
    reads={"cpu": {"latency_s": 1e-4, "bytes_per_s": 20e9}, "disk": {"latency_s": 5e-4, "bytes_per_s": 3e9},
           "remote": {"latency_s": 1e-3, "bytes_per_s": 1.5e9}},
    decode_s_per_token=0.02,
    source="assumed defaults (a GPU serving an 8B model; run `kvstrata plan --measure PROFILE` on the serving "
           "machine and pass --profile)")


def read_profile(path: str | Path) -> Speeds:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return Speeds(step={k: float(v) for k, v in data["step"].items()},
                      reads={t: {k: float(v) for k, v in r.items()} for t, r in data["reads"].items()},
                      decode_s_per_token=float(data["decode_s_per_token"]), source=f"measured: {data['source']}")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a profile written by `kvstrata plan --measure` ({exc!r})") from None


def measure(config_path: str | None, overrides: list[str], out: str | Path) -> Speeds:
    """Start the engine on this (the serving) machine, let it measure itself as it does at every start (the
    step-cost probe, each lower tier's load probe: engine/llm_engine.py, engine/kv_manager.py), time a short
    decode, and write those speeds to `out` as a profile."""
    from kvstrata import LLM, SamplingParams
    from kvstrata.engine.config import load_config

    config = load_config(config_path, overrides)
    llm = LLM(config)
    try:
        prompt = [[1 + i % 100 for i in range(64)]]
        llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))  # warm up

        def timed(max_tokens: int) -> float:
            started = time.perf_counter()
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0))
            assert len(out[0].token_ids) == max_tokens
            return time.perf_counter() - started

        # prefills of several lengths, none cached: the step cost the engine fits from its own steps (it starts from
        # a short probe) then holds for the prompt lengths a trace asks for
        room = llm.engine.hierarchy.pool.num_blocks * config.cache.block_size // 2
        prefills: list[tuple[int, float]] = []  # (prompt tokens, seconds to its first token)
        for k, n in enumerate(n for n in (64, 128, 256, 512, 1024) if n <= room):
            for repeat in range(2):
                fresh = [100 + (7919 * (i + 1) * (k + 1) * (repeat + 3)) % 40000 for i in range(n)]
                started = time.perf_counter()
                llm.generate([fresh], SamplingParams(max_tokens=1, temperature=0.0))
                prefills.append((n, time.perf_counter() - started))
        decode_tokens = 32
        longer = min(timed(decode_tokens + 1) for _ in range(2))
        decode_s = longer - min(timed(1) for _ in range(2))
        if decode_s <= 0:  # noise larger than the decodes: count the whole call as decoding (an upper bound)
            decode_s = longer
        stats = llm.stats()
    finally:
        llm.close()
    policy = stats["load_policy"]
    step = {k: float(v) for k, v in policy["step_cost"].items()}
    if step.get("per_token_s", 0.0) <= 0:  # the engine's fit found no slope (a noisy machine): the prefills' own
        step["per_token_s"] = _slope(prefills)
    speeds = Speeds(step=step,
                    reads={t: {"latency_s": policy["read_latency_s"][t], "bytes_per_s": policy["read_bytes_per_s"][t]}
                           for t in policy["read_bytes_per_s"]  # the tiers the config has, which the probe timed
                           if policy["read_bytes_per_s"][t] > 0 or policy["read_latency_s"][t] > 0},
                    decode_s_per_token=decode_s / decode_tokens,
                    source=f"{platform.node()}, {stats['device']}, {stats['model']}, {time.strftime('%Y-%m-%d')}")
    Path(out).write_text(json.dumps({"version": PROFILE_VERSION, **asdict(speeds)}, indent=2) + "\n", encoding="utf-8")
    return speeds


# ------------------------------------------------------------------------------------------ replay

@dataclass
class Tally:
    """What a replay counts (tokens and blocks); `summary` turns it into the printed figures."""

    requests: int = 0
    prompt_tokens: int = 0
    served_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    promotions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIER_NAMES, 0))
    write_downs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIER_NAMES, 0))
    device_evictions: int = 0
    waited: int = 0          # requests that found too few free device blocks and waited for running ones
    too_large: int = 0       # requests needing more blocks than the whole device tier (computed, never cached)
    ttft_s: list[float] = field(default_factory=list)


@dataclass
class Admission:
    """A request's cache, as admitted: its device blocks (prompt and answer) and what served its prefix."""

    blocks: list
    served: dict[int, str]   # chain position -> the tier whose block it uses (device hits and loaded blocks)
    wait_until: float        # when the running requests that had to finish for its room had finished (0: none)


class ReplayEngine:
    """One engine's cache, payloads left out: the real `BlockPool` and the tier policy the hierarchy asks
    (`TierPolicy`, tiers/policy.py) over `LruIndex` lower tiers, its answers applied to hashes in the order
    `TierHierarchy` and the KV manager apply them to bytes."""

    def __init__(self, device_blocks: int, cpu: LruIndex | None, disk: LruIndex | None, remote: LruIndex | None,
                 offload: str, tally: Tally, enable_caching: bool = True, offload_answers: bool = False) -> None:
        self.pool = BlockPool(device_blocks, enable_caching=enable_caching, on_evict=self._on_device_evict)
        self.policy = TierPolicy(self.pool, cpu, disk, remote, offload, offload_answers)
        self.cpu, self.disk, self.remote = cpu, disk, remote
        self.lower_tiers = self.policy.lower_tiers
        self.tally = tally
        if cpu is not None and disk is not None:
            cpu.on_evict = self._on_cpu_evict
        self.running: list[tuple[float, int, list]] = []  # (finish time, order, blocks) heap

    def locate(self, chain: Sequence) -> list[str]:
        return self.policy.locate(chain)

    def _on_device_evict(self, block_id: int, block_hash) -> None:
        self.tally.device_evictions += 1
        if self.policy.device_evicting(block_id):
            self.write_down([block_hash])

    def _on_cpu_evict(self, block_hash) -> None:
        target, held = self.policy.cascade_target(block_hash)
        if held:
            target.put([block_hash])  # only made the most recent there: no write-down
        elif target is not None:
            self.write_down([block_hash], [target])

    def write_down(self, hashes: list, targets: Sequence[LruIndex] | None = None) -> None:
        for tier in self.policy.write_down_targets if targets is None else targets:
            tier.put(hashes)
            self.tally.write_downs[tier.name] += len(hashes)

    def admit(self, chain: Sequence, found: Sequence[str], use_device: Sequence[int], use_below: Sequence[int],
              total_blocks: int, answer: Sequence = ()) -> Admission | None:
        """Hold the device hits at positions `use_device` and the lower-tier hits at `use_below`, make room for
        `total_blocks` blocks in all, load the lower-tier hits, compute and cache the rest of the chain and the
        `answer`'s full blocks (their hashes: a trace's answers are never asked for again), and write down as the
        policy says: `TierHierarchy.acquire_prefix`, `finish_prefix`, the KV manager's allocation and
        `cache_blocks`, then `flush_pending` after the step. None when the request cannot fit the device."""
        pool, policy = self.pool, self.policy
        hits = pool.get_cached_blocks([chain[k] for k in use_device])
        pool.touch(hits)
        policy.device_blocks_reused(hits)
        below = [chain[k] for k in use_below]
        below_found = [found[k] for k in use_below]
        policy.hold_below(below, below_found, hold=True)  # so that no write-down the allocation causes evicts them
        wait_until = self.make_room(total_blocks - len(hits))
        if wait_until is None:
            pool.free_blocks(reversed(hits))
            policy.hold_below(below, below_found, hold=False)
            return None
        loaded = policy.blocks_for_load(len(below))
        served_from = self._read_below(below)
        arrived = [i for i, tier in enumerate(served_from) if tier is not None]
        newly = {b.block_id for b in pool.cache_full_blocks([loaded[i] for i in arrived], [below[i] for i in arrived],
                                                            0, len(arrived))}
        policy.hold_below(below, below_found, hold=False)
        up = [below[i] for i in arrived if policy.copy_up_target(served_from[i]) is not None
              and loaded[i].block_id in newly]
        if up:  # disk and remote hits are copied up: the next miss is a cheap, local one
            self.write_down(up, [policy.cpu])
        # the prefix ends at the first block not served; what is held past it is let go, tail first
        stop = use_below[served_from.index(None)] if None in served_from else len(chain)
        used = {**{k: b for k, b in zip(use_device, hits)}, **{k: loaded[i] for i, k in enumerate(use_below)}}
        served = {k: "device" for k in use_device if k < stop}
        served.update({k: served_from[i] for i, k in enumerate(use_below) if k < stop})
        pool.free_blocks(reversed([used[k] for k in sorted(used) if k >= stop]))
        for k in served:
            if served[k] != "device":
                self.tally.promotions[served[k]] += 1
        new = iter(pool.get_new_blocks(total_blocks - len(served)))
        blocks = [used[k] if k in served else next(new) for k in range(len(chain))]
        blocks.extend(new)  # the answer's and the last partial block
        computed = []  # cache the blocks computed, a run of them at a time
        for is_used, run in itertools.groupby(range(len(chain)), key=served.__contains__):
            if not is_used:
                run = list(run)
                computed += pool.cache_full_blocks(blocks, list(chain), run[0], run[-1] + 1)
        answered = pool.cache_full_blocks(blocks, [*chain, *answer], len(chain), len(chain) + len(answer))
        policy.block_computed(computed, answered)
        _, pending = policy.take_pending()  # the step that computed them is over
        if pending:
            self.write_down(pending)
        return Admission(blocks, served, wait_until)

    def _read_below(self, hashes: list) -> list[str | None]:
        """The tier that serves each block a load reads (None: none holds it now): each tier in order is asked for
        what is still missing, and what it serves becomes its most recently used."""
        served_from: list[str | None] = [None] * len(hashes)
        for tier in self.lower_tiers:
            found = [i for i, t in enumerate(served_from) if t is None and tier.contains(hashes[i])]
            tier.touch([hashes[i] for i in found])
            for i in found:
                served_from[i] = tier.name
        return served_from

    def finish_until(self, now: float) -> None:
        """Free the blocks of every request done by `now`, tail first, as a finished request frees them."""
        running, free = self.running, self.pool.free_blocks
        while running and running[0][0] <= now:
            free(reversed(heapq.heappop(running)[2]))

    def make_room(self, num_blocks: int) -> float | None:
        """Finish running requests, earliest first, until `num_blocks` are free; the time the last one
        finished (the wait), or None when even an empty device is too small."""
        if num_blocks > self.pool.num_blocks:
            return None
        finished_at = 0.0
        while self.pool.num_free_blocks < num_blocks:
            if not self.running:  # (the request's own device hits hold the rest)
                return None
            finished_at, _, blocks = heapq.heappop(self.running)
            self.pool.free_blocks(reversed(blocks))
        return finished_at

    def held_prefix(self, chain: Sequence, media: tuple[str, ...]) -> int:
        """How many leading blocks of `chain` the device and the lower tiers named in `media` (its CPU and disk
        tiers; the remote one is every replica's) hold: what a replica's KV events tell the router."""
        cached = self.pool.cached_block_hash_to_block
        lower = [t.order for t in (self.cpu, self.disk) if t is not None and t.name in media]
        n = 0
        for h in chain:
            if h not in cached and not any(h in order for order in lower):
                break
            n += 1
        return n


class Planner:
    """Replays a trace through the tiers `config` describes (sizes for the machine being planned)."""

    def __init__(self, config, speeds: Speeds, trace_block_tokens: int = TRACE_BLOCK_TOKENS,
                 replicas: int = 1, route: str = "round_robin", remote_size: str | int | Size | None = None) -> None:
        from kvstrata.engine.config.machine import TierBytes

        cache = config.cache
        if trace_block_tokens % cache.block_size:
            raise ValueError(f"--trace-block-tokens: {trace_block_tokens} is not a multiple of cache.block_size "
                             f"({cache.block_size})")
        if route not in ROUTES:
            raise ValueError(f"--route: unknown policy {route!r} (use one of {', '.join(ROUTES)})")
        self.config = config
        self.block_size = cache.block_size
        self.per_id = trace_block_tokens // cache.block_size
        self.trace_block_tokens = trace_block_tokens
        sizing = TierBytes(config)
        self.block_nbytes = sizing.block_nbytes
        tiers = cache.tiers
        self.capacity = {"device": sizing(tiers.device.size) // self.block_nbytes,
                         "cpu": sizing(tiers.cpu.size) // self.block_nbytes if tiers.cpu else 0,
                         "disk": sizing(tiers.disk.size) // self.block_nbytes if tiers.disk else 0,
                         # the remote server's own memory bounds it, which the config does not say: unbounded
                         # unless given here
                         "remote": (self._blocks(remote_size, sizing) if remote_size is not None else None)
                         if tiers.remote else 0}
        self.speeds = speeds
        self.step_cost = speeds.step_cost()
        self.read_costs = speeds.read_costs(self.block_nbytes)
        self.load_policy = cache.load_policy if cache.enable_prefix_caching else "always_recompute"
        self.replicas = replicas
        self.route = route

    def _blocks(self, size: str | int | Size, sizing) -> int:
        return max(sizing(parse_remote_size(size)) // self.block_nbytes, 1)

    def replay(self, requests: Sequence[TraceRequest]) -> dict[str, Any]:
        started = time.perf_counter()
        tally = Tally()
        cap = self.capacity
        # replicas share one disk and one remote tier; each has its own device and CPU tiers. Only the CPU tier keeps
        # a promotion's blocks from eviction: the others are shared with other processes (`LowerTier.hold`).
        disk = LruIndex("disk", cap["disk"], keeps_holds=False) if cap["disk"] else None
        remote = LruIndex("remote", cap["remote"], keeps_holds=False) if cap["remote"] != 0 else None
        engines = [ReplayEngine(max(cap["device"], 1), LruIndex("cpu", cap["cpu"]) if cap["cpu"] else None, disk,
                                remote, self.config.cache.offload, tally, self.config.cache.enable_prefix_caching,
                                self.config.cache.offload_answers)
                   for _ in range(self.replicas)]
        choose = self._prefix_router(engines) if self.route == "prefix" and len(engines) > 1 else None
        per_id, bs = self.per_id, self.block_size
        offsets = range(per_id)
        order = itertools.count()
        # in arrival order (a server's own trace is written as requests end); the sort is stable
        for k, request in enumerate(sorted(requests, key=lambda r: r.timestamp_ms)):
            now = request.timestamp_ms / 1000.0
            for engine in engines:
                engine.finish_until(now)
            ids = request.hash_ids
            # an id names its prefix, so (id, position in its span) names a block's whole prefix, as a chain hash
            chain = [i * per_id + j for i in ids for j in offsets]
            num_tokens = _prompt_tokens(request.input_length, len(ids), self.trace_block_tokens)
            chain = chain[:num_tokens // bs]  # full blocks only are cached
            # the answer scaled as the prompt was (ids standing for fewer tokens than the trace's make both shorter)
            output_length = round(request.output_length * num_tokens / max(request.input_length, 1))
            engine = engines[k % len(engines)] if choose is None else choose(chain)
            self._serve(engine, chain, num_tokens, output_length, now, next(order), tally)
        result = self._summary(tally, engines)
        result["replay_s"] = time.perf_counter() - started
        return result

    def _serve(self, engine: ReplayEngine, chain: list, num_tokens: int, output_length: int, now: float,
               order: int, tally: Tally) -> None:
        """One request: looked up, planned by the load policy, admitted as the engine admits it."""
        bs = self.block_size
        tally.requests += 1
        tally.prompt_tokens += num_tokens
        max_hit = (num_tokens - 1) // bs  # the last token is always computed, for its logits
        found = engine.locate(chain[:max_hit])
        plan = choose_plan(self.load_policy, found, num_tokens, bs, self.step_cost, self.read_costs)
        # used as they are: the device hits before the plan's head and those among its loaded tail
        use_device = [*range(plan.device_run), *(k for k in range(plan.head_end, plan.cut) if found[k] == "device")]
        use_below = [k for k in range(plan.head_end, plan.cut) if found[k] != "device"]
        total_blocks = -(-(num_tokens + output_length) // bs)
        # the answer's full blocks, all but its last token computed (fed back to compute the next one); each block a
        # hash of its own: no trace asks an answer again
        num_answer_blocks = max((num_tokens + output_length - 1) // bs - len(chain), 0)
        answer = [("answer", order, j) for j in range(num_answer_blocks)]
        admitted = engine.admit(chain, found, use_device, use_below, total_blocks, answer)
        if admitted is None:  # larger than the device tier: it cannot run here; counted, never cached
            tally.too_large += 1
            return
        if admitted.wait_until > now:
            tally.waited += 1
        start = max(now, admitted.wait_until)
        for tier in admitted.served.values():
            tally.served_tokens[tier] += bs
        ttft = self._ttft_s(found, plan, num_tokens)
        tally.ttft_s.append(ttft + (start - now))
        done = start + ttft + output_length * self.speeds.decode_s_per_token
        heapq.heappush(engine.running, (done, order, admitted.blocks))

    def _ttft_s(self, found: Sequence[str], plan: LoadPlan, num_tokens: int) -> float:
        """The load policy's estimate of the plan (engine/load_policy.py): the head computed beside the
        tail's load, then the rest."""
        bs = self.block_size
        head = self.step_cost.step_s((plan.head_end - plan.device_run) * bs, plan.device_run * bs)
        counts: dict[str, int] = {}
        for tier in found[plan.head_end:plan.cut]:
            counts[tier] = counts.get(tier, 0) + 1
        tail = sum(self.read_costs[t].load_s(n) for t, n in counts.items())
        rest = self.step_cost.step_s(num_tokens - plan.cut * bs, plan.cut * bs)
        return max(head, tail) + rest

    def _prefix_router(self, engines: list[ReplayEngine]):
        """The router's own placement (kvstrata/serving/router.py `ReplicaSet.choose`) over the engines,
        each replica's index answered from its replayed device, CPU and disk tiers."""
        from kvstrata.serving.router import Replica, ReplicaSet

        class ReplayedIndex:
            def __init__(self, engine: ReplayEngine) -> None:
                self.engine = engine

            def prefix_length(self, block_hashes, media) -> int:
                return self.engine.held_prefix(block_hashes, media)

        replicas = [Replica(config=None, subscriber=None, index=ReplayedIndex(e)) for e in engines]
        replica_set = ReplicaSet(replicas, max_load_gap=16)
        engine_of = {id(r): e for r, e in zip(replicas, engines)}

        def choose(chain: list) -> ReplayEngine:
            for r, e in zip(replicas, engines):
                r.in_flight = len(e.running)
            best, _ = replica_set.choose(dict.fromkeys(replicas, chain), set())  # every replica names blocks alike
            return engine_of[id(best)]

        return choose

    def _summary(self, tally: Tally, engines: list[ReplayEngine]) -> dict[str, Any]:
        prompt = max(tally.prompt_tokens, 1)
        by_tier = {t: tally.served_tokens[t] / prompt for t in TIER_NAMES}
        ttft = sorted(tally.ttft_s)
        lower = {t.name: t for e in engines for t in e.lower_tiers}
        evictions = {"device": tally.device_evictions,
                     **{t: (sum(e.cpu.evictions for e in engines if e.cpu) if t == "cpu" else lower[t].evictions)
                        if t in lower else 0 for t in LOWER_TIER_NAMES}}
        nbytes = self.block_nbytes
        return {
            "hit_ratio": sum(by_tier.values()),
            "by_tier": by_tier,
            "requests": tally.requests,
            "prompt_tokens": tally.prompt_tokens,
            "ttft_ms": {"mean": 1000 * sum(ttft) / len(ttft) if ttft else 0.0,
                        "p50": 1000 * _quantile(ttft, 0.5), "p90": 1000 * _quantile(ttft, 0.9),
                        "p99": 1000 * _quantile(ttft, 0.99)},
            "evictions": evictions,
            "promoted_bytes": {t: n * nbytes for t, n in tally.promotions.items()},
            "written_down_bytes": {t: n * nbytes for t, n in tally.write_downs.items()},
            "capacity_blocks": dict(self.capacity),
            "block_bytes": nbytes,
            "waited": tally.waited,
            "too_large": tally.too_large,
            "replicas": self.replicas,
            "route": self.route,
            "speeds": self.speeds.source,
        }


def _prompt_tokens(input_length: int, num_ids: int, block_tokens: int) -> int:
    """The prompt's tokens: `input_length` held within its ids' span (the last id's span partly filled)."""
    if num_ids == 0:
        return max(input_length, 1)
    return min(max(input_length, (num_ids - 1) * block_tokens + 1), num_ids * block_tokens)


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ------------------------------------------------------------------------------------------ sweeps

@dataclass
class Point:
    settings: dict[str, str]   # the swept keys' values at this point
    config: Any
    result: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        """What this point's tiers cost in memory and disk (the remote tier, sized by its server, aside)."""
        from kvstrata.engine.config.machine import TierBytes

        tiers, sizing = self.config.cache.tiers, TierBytes(self.config)
        return sum(sizing(t.size) for t in (tiers.device, tiers.cpu, tiers.disk) if t is not None)


def parse_sweeps(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    sweeps = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not options:
            raise ValueError(f"--sweep {spec!r}: expected dotted.key=value1,value2,...")
        sweeps.append((key.strip(), options))
    return sweeps


def run_sweep(config_path: str | None, overrides: list[str], sweeps: list[tuple[str, list[str]]],
              requests: Sequence[TraceRequest], speeds: Speeds, **planner_args) -> list[Point]:
    from kvstrata.engine.config import load_config

    points = []
    for values in itertools.product(*(options for _, options in sweeps)):
        settings = {key: value for (key, _), value in zip(sweeps, values)}
        config = load_config(config_path, [*overrides, *(f"{k}={v}" for k, v in settings.items())],
                             for_machine=False)
        points.append(Point(settings, config, Planner(config, speeds, **planner_args).replay(requests)))
    return points


def recommend(points: list[Point], target: float) -> Point:
    """The cheapest point (fewest bytes of device, CPU and disk) whose hit ratio is within `target` of the best."""
    best = max(p.result["hit_ratio"] for p in points)
    good = [p for p in points if p.result["hit_ratio"] >= target * best]
    return min(good, key=lambda p: (p.total_bytes, -p.result["hit_ratio"]))


def plot_sweep(points: list[Point], sweeps: list[tuple[str, list[str]]], path: str | Path) -> None:
    """Hit ratio and projected mean TTFT against the first swept key, one line per value of the others."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = sweeps[0][0]
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[str, list[Point]] = {}
    for p in points:
        label = ", ".join(f"{k}={v}" for k, v in p.settings.items() if k != x_key) or "this config"
        lines.setdefault(label, []).append(p)
    for label, line in lines.items():
        xs = list(range(len(line)))
        ax_hit.plot(xs, [p.result["hit_ratio"] for p in line], marker="o", label=label)
        ax_ttft.plot(xs, [p.result["ttft_ms"]["mean"] for p in line], marker="o", label=label)
    ticks = [p.settings[x_key] for p in next(iter(lines.values()))]
    for ax, ylabel in ((ax_hit, "prefix hit ratio (share of prompt tokens)"), (ax_ttft, "projected mean TTFT (ms)")):
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_hit.set_ylim(0, 1)
    ax_hit.legend(fontsize=7)
    fig.suptitle("kvstrata plan")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ output

def format_result(result: dict[str, Any]) -> str:
    by = result["by_tier"]
    t = result["ttft_ms"]
    mib = 1 << 20
    lines = [
        f"requests: {result['requests']}  prompt tokens: {result['prompt_tokens']}  "
        f"replicas: {result['replicas']} ({result['route']})  replayed in {result.get('replay_s', 0):.1f} s",
        f"hit ratio: {result['hit_ratio']:.3f}  (" + ", ".join(f"{k} {v:.3f}" for k, v in by.items()) + ")",
        f"projected TTFT: mean {t['mean']:.1f} ms, p50 {t['p50']:.1f}, p90 {t['p90']:.1f}, p99 {t['p99']:.1f}"
        f"  [speeds: {result['speeds']}]",
        "evictions: " + ", ".join(f"{k} {v}" for k, v in result["evictions"].items()),
        "promoted: " + ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in result["promoted_bytes"].items()),
        "written down: " + ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in result["written_down_bytes"].items()),
        "capacity (blocks of {} bytes): ".format(result["block_bytes"])
        + ", ".join(f"{k} {'unbounded' if v is None else v}" for k, v in result["capacity_blocks"].items()),
    ]
    if result["waited"] or result["too_large"]:
        lines.append(f"requests that waited for device room: {result['waited']}; larger than the device tier: "
                     f"{result['too_large']}")
    return "\n".join(lines)


def format_table(points: list[Point], keys: list[str]) -> str:
    header = [*keys, "hit", *TIER_NAMES, "ttft_mean_ms", "ttft_p90_ms"]
    rows = [[*(p.settings[k] for k in keys), f"{p.result['hit_ratio']:.3f}",
             *(f"{p.result['by_tier'][t]:.3f}" for t in TIER_NAMES),
             f"{p.result['ttft_ms']['mean']:.1f}", f"{p.result['ttft_ms']['p90']:.1f}"] for p in points]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def tiers_yaml(config) -> str:
    """The `cache:` part of the YAML a recommended point needs (sizes as given)."""
    import yaml

    data = config.to_dict()["cache"]
    keep = {"block_size": data["block_size"], "offload": data["offload"], "offload_answers": data["offload_answers"],
            "tiers": {k: v for k, v in data["tiers"].items() if v is not None}}
    return yaml.safe_dump({"cache": keep}, sort_keys=False, default_flow_style=False)


# ------------------------------------------------------------------------------------------ command line

def parse_remote_size(size: str | int | Size) -> Size:
    """`--remote-size` as a `Size`; ValueError, one line, unless it is a size more than 0."""
    try:
        parsed = Size.parse(size)
    except ValueError as exc:
        raise ValueError(f"--remote-size: {exc}") from None
    if parsed.is_off:
        raise ValueError("--remote-size: must be more than 0 (leave the remote tier out to turn it off)")
    return parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="a Mooncake-format trace (JSON lines: timestamp, input_length, "
                                        "output_length, hash_ids)")
    parser.add_argument("--trace-block-tokens", type=positive_int, default=TRACE_BLOCK_TOKENS,
                        help=f"tokens one trace id stands for (default {TRACE_BLOCK_TOKENS}, the Mooncake traces')")
    parser.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    parser.add_argument("--profile", help="speeds measured by `kvstrata plan --measure` (default: stated defaults)")
    parser.add_argument("--measure", metavar="PROFILE", help="measure this machine's speeds with the config and "
                                                              "write them to PROFILE, for --profile")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="replay once per value (repeatable: several keys make a grid)")
    parser.add_argument("--plot", help="with --sweep: write hit ratio and projected TTFT against size to this PNG")
    parser.add_argument("--target", type=float, default=0.95,
                        help="with --sweep: recommend the smallest configuration within this share of the best "
                             "hit ratio (default 0.95)")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="plan N engines sharing the disk and remote tiers")
    parser.add_argument("--route", default="round_robin", choices=ROUTES,
                        help="how requests reach the replicas (prefix: the router's own placement)")
    parser.add_argument("--remote-size", metavar="SIZE", help="the remote server's memory for blocks, e.g. 512GiB "
                                                               "(its maxmemory; default: unbounded)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from kvstrata.engine.config import load_config

    overrides = list(args.overrides or [])
    if args.measure:
        speeds = measure(args.config, overrides, args.measure)
        print(f"wrote {args.measure}: {speeds.source}")
        if args.json:
            print(json.dumps(asdict(speeds)))
        return 0
    if not args.trace:
        raise ValueError("plan: give --trace FILE (or --measure PROFILE)")
    if not 0 < args.target <= 1:
        raise ValueError(f"--target: must be in (0, 1], got {args.target}")
    if args.plot:
        _check_plot(args.plot, args.sweep)
    # checked here even where the config has no remote tier to bound: a size that is none is a mistake either way
    remote_size = parse_remote_size(args.remote_size) if args.remote_size is not None else None
    speeds = read_profile(args.profile) if args.profile else DEFAULT_SPEEDS
    requests = _read_requests(args.trace, args.limit)
    planner_args = {"trace_block_tokens": args.trace_block_tokens, "replicas": args.replicas, "route": args.route,
                    "remote_size": remote_size}
    if not args.sweep:
        config = load_config(args.config, overrides, for_machine=False)
        result = Planner(config, speeds, **planner_args).replay(requests)
        print(format_result(result))
        if args.json:
            print(json.dumps(result))
        return 0
    sweeps = parse_sweeps(args.sweep)
    points = run_sweep(args.config, overrides, sweeps, requests, speeds, **planner_args)
    print(format_table(points, [k for k, _ in sweeps]))
    best = recommend(points, args.target)
    print(f"\nrecommended (the smallest within {args.target:.0%} of the best hit ratio): "
          + ", ".join(f"{k}={v}" for k, v in best.settings.items())
          + f"  hit ratio {best.result['hit_ratio']:.3f}, projected mean TTFT {best.result['ttft_ms']['mean']:.1f} ms")
    print(tiers_yaml(best.config), end="")
    print(f"[speeds: {speeds.source}]")
    if args.plot:
        plot_sweep(points, sweeps, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({**best.result, "recommended": best.settings,
                          "points": [{"settings": p.settings, **p.result} for p in points]}))
    return 0


def _check_plot(path: str, sweep: list[str]) -> None:
    """Before the sweep, which may take minutes, rather than after it: the plot needs one, and a folder to go to."""
    if not sweep:
        raise ValueError("--plot: needs --sweep")
    folder = Path(path).parent
    if not folder.is_dir():
        raise ValueError(f"--plot: no folder {str(folder)!r} to write {Path(path).name!r} in")


def _read_requests(path: str, limit: int | None) -> list[TraceRequest]:
    """The trace's first `limit` requests; ValueError, one line naming the file, for one that is no trace or has none."""
    requests = read_trace(path, limit)
    if not requests:
        raise ValueError(f"{path}: the trace holds no request")
    return requests


def _slope(points: list[tuple[int, float]]) -> float:
    """Seconds per token of a least-squares line through (tokens, seconds); at least a nanosecond."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return max(cov / var if var else mean_y / max(mean_x, 1), 1e-9)
