"""`kvstrata plan` answers for the cache we ship: one random sequence of requests and finishes, driven through the
real `TierHierarchy` (real CPU and LMDB disk tiers, bytes moved by the transfer engine) and through the planner's
replay of the same tier policy over payload-free LRU indexes, leaves both in the same state at every step: where
each block is found, what each tier holds (the CPU tier in LRU order), what was evicted, written down and promoted.

The hierarchy's write-downs run on the transfer engine's store thread, beside its loads: the test lets them land
after each of a request's phases, and holds a load's reads until the write-downs its allocation caused have landed
(the replay applies each at once, in that order). The disk tier commits each put before the next here: its writer
batches them, and a put's evictions are not seen (`contains`) until its batch commits."""
from __future__ import annotations

import subprocess
import sys
import tempfile

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tier_cases import GatedTier

from kvstrata.engine.hashing import BlockHasher
from kvstrata.planner import ReplayEngine, Tally
from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.hierarchy import TierHierarchy
from kvstrata.tiers.lru import LruIndex
from kvstrata.tiers.record import RecordCodec

BS = 4
LAYOUT = BlockLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=4, dtype=torch.float32)
HASHER = BlockHasher(BS, b"policy-test", "xxh3_128")
DEVICE_BLOCKS, CPU_BLOCKS, DISK_BLOCKS = 10, 5, 8
DOCUMENTS = [[1000 * d + i for i in range(8 * BS)] for d in range(5)]  # 8 blocks each, sharing no prefix


class CommittingTier(GatedTier):
    """A gated tier whose puts have committed when they return."""

    def put(self, block_hashes, token_ids, srcs, parents=None):
        self.inner.put(block_hashes, token_ids, srcs, parents)
        self.inner.flush()


class Real:
    """The shipped cache: a hierarchy over a block pool, a CPU tier and an LMDB disk tier (whose reads wait for
    their gates)."""

    def __init__(self, disk_path: str, offload: str) -> None:
        self.pool = BlockPool(DEVICE_BLOCKS)
        self.cpu = CpuTier(LAYOUT, CPU_BLOCKS)
        self.disk = DiskTier(LAYOUT, disk_path, DISK_BLOCKS * RecordCodec(LAYOUT).record_nbytes,
                             check_integrity=False)
        self.gated = [GatedTier(self.cpu), CommittingTier(self.disk)]
        self.h = TierHierarchy(self.pool, LAYOUT.allocate(DEVICE_BLOCKS), *self.gated, offload)

    def settle(self) -> None:
        self.h.wait_for_write_downs()
        self.disk.flush()

    def admit(self, chain: list[bytes], tokens: list[tuple[int, ...]], total_blocks: int):
        found = self.h.locate(chain)
        for tier in self.gated:
            tier.gate.clear()
        load = self.h.acquire_prefix(chain, tokens, found)
        self.settle()  # the write-downs the load's allocation caused land before it reads
        for tier in self.gated:
            tier.gate.set()
        assert load.transfer is None or load.transfer.wait(10)
        hit = self.h.finish_prefix(load)
        self.settle()
        blocks = hit.blocks + self.pool.get_new_blocks(total_blocks - hit.num_blocks)
        self.settle()
        self.h.cache_blocks(blocks, chain, tokens[hit.num_blocks:], hit.num_blocks, len(chain))
        self.h.flush_pending()  # the step that computed them is over
        self.settle()
        return found, hit.tiers, blocks


class Replay:
    """The planner's replay of the same cache."""

    def __init__(self, offload: str) -> None:
        self.tally = Tally()
        self.engine = ReplayEngine(DEVICE_BLOCKS, LruIndex("cpu", CPU_BLOCKS),
                                   LruIndex("disk", DISK_BLOCKS, keeps_holds=False), None, offload, self.tally)

    def admit(self, chain: list[bytes], total_blocks: int):
        found = self.engine.locate(chain)
        use_device = [k for k, t in enumerate(found) if t == "device"]
        use_below = [k for k, t in enumerate(found) if t != "device"]
        admitted = self.engine.admit(chain, found, use_device, use_below, total_blocks)
        assert admitted is not None
        return found, [admitted.served[k] for k in sorted(admitted.served)], admitted.blocks


def assert_same_state(real: Real, replay: Replay, every_hash: list[bytes]) -> None:
    engine, tally = replay.engine, replay.tally
    free = [(b.block_id, b.block_hash) for b in real.pool.free_block_queue.get_all_free_blocks()]
    assert free == [(b.block_id, b.block_hash) for b in engine.pool.free_block_queue.get_all_free_blocks()]
    assert real.pool.cached_block_hash_to_block.keys() == engine.pool.cached_block_hash_to_block.keys()
    assert [h for h, *_ in real.cpu.blocks()] == list(engine.cpu.order)  # least recently used first
    assert real.disk.held(every_hash) == [engine.disk.contains(h) for h in every_hash]
    counters = real.h.counters
    assert counters.device_evictions == tally.device_evictions
    assert (real.cpu.stats().evictions, real.disk.stats().evictions) == (engine.cpu.evictions, engine.disk.evictions)
    assert counters.write_downs == tally.write_downs
    assert counters.promotions == tally.promotions


REQUEST = st.tuples(st.just("request"), st.integers(0, len(DOCUMENTS) - 1), st.integers(1, 8), st.integers(0, 2))
FINISH = st.tuples(st.just("finish"), st.integers(0, 7), st.just(0), st.just(0))


# derandomized: the same sequences every run; not shrunk (minutes, each step being a real hierarchy's)
@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(offload=st.sampled_from(["write_through", "on_evict"]),
       ops=st.lists(st.one_of(REQUEST, REQUEST, FINISH), min_size=20, max_size=50))
def test_the_planner_replays_the_hierarchy_block_for_block(offload, ops):
    chains = [HASHER.hash(d) for d in DOCUMENTS]
    every_hash = [h for chain in chains for h in chain]
    with tempfile.TemporaryDirectory() as disk_path:
        real, replay = Real(disk_path, offload), Replay(offload)
        running: list[tuple[list, list]] = []  # (real blocks, replayed blocks) of each request not finished
        try:
            for op, a, b, c in ops:
                if op == "finish":
                    if running:
                        real_blocks, replayed = running.pop(a % len(running))
                        real.pool.free_blocks(reversed(real_blocks))  # tail first, as a finished request
                        replay.engine.pool.free_blocks(reversed(replayed))
                    continue
                chain, total_blocks = chains[a][:b], b + c
                tokens = [tuple(DOCUMENTS[a][k * BS:(k + 1) * BS]) for k in range(b)]
                while running and real.pool.num_free_blocks < total_blocks:  # room, as the scheduler waits for it
                    real_blocks, replayed = running.pop(0)
                    real.pool.free_blocks(reversed(real_blocks))
                    replay.engine.pool.free_blocks(reversed(replayed))
                found, tiers, real_blocks = real.admit(chain, tokens, total_blocks)
                replayed_found, replayed_tiers, replayed = replay.admit(chain, total_blocks)
                assert (replayed_found, replayed_tiers) == (found, tiers)
                running.append((real_blocks, replayed))
                assert_same_state(real, replay, every_hash)
        finally:
            real.h.close()


def test_the_policy_and_the_planner_load_without_torch():
    """`kvstrata plan` replays the policy in a process that never imports torch (a planning machine needs none)."""
    code = "import sys, kvstrata.tiers.policy, kvstrata.planner; print(sorted(m for m in ('torch',) if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
