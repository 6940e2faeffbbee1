"""The tier hierarchy and the KV manager, without a model.

A fake "model step" fills each computed block with bytes derived from the block's chain hash (a
block's K/V are a function of its whole prefix, as the hash is), so every promotion can be checked
byte for byte: a hit served with the wrong content would show.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from tier_cases import GatedTier

from kvstrata.engine.hashing import BlockHasher
from kvstrata.engine.kv_manager import KVCacheManager
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import SamplingParams
from kvstrata.tiers.base import BlockLayout, as_bytes
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers.hierarchy import TierHierarchy

BS = 4
LAYOUT = BlockLayout(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=8, dtype=torch.float32)
HASHER = BlockHasher(BS, b"test-namespace", "xxh3_128")


def content_for(block_hash: bytes) -> torch.Tensor:
    """The bytes a block with this chain hash must hold (deterministic, distinct per hash)."""
    g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (LAYOUT.block_nbytes,), dtype=torch.uint8, generator=g)


def make_stack(device_blocks: int, cpu_blocks: int = 0, disk_path=None, disk_blocks: int = 0,
               offload: str = "write_through", gate_cpu: bool = False, remote_url: str | None = None,
               disk_records: int | None = None, offload_answers: bool = False):
    """A KV manager over a device pool and the lower tiers asked for; `gate_cpu` wraps the CPU tier
    in a `GatedTier` (its reads wait for `hierarchy.cpu.gate`); `remote_url` adds a remote tier; `disk_records`
    sizes the disk tier to exactly that many blocks (else it holds about twice `disk_blocks`)."""
    pool = BlockPool(device_blocks)
    kv = LAYOUT.allocate(device_blocks)
    cpu = CpuTier(LAYOUT, cpu_blocks) if cpu_blocks else None
    if gate_cpu:
        cpu = GatedTier(cpu)
    disk = None
    if disk_path is not None:
        from kvstrata.tiers.disk import DiskTier
        from kvstrata.tiers.record import RecordCodec
        capacity = disk_blocks * LAYOUT.block_nbytes * 2 if disk_records is None else \
            disk_records * RecordCodec(LAYOUT).record_nbytes
        disk = DiskTier(LAYOUT, str(disk_path), capacity)
    remote = None
    if remote_url is not None:
        from kvstrata.tiers.remote import RemoteTier
        remote = RemoteTier(LAYOUT, remote_url, timeout=0.5)
    hierarchy = TierHierarchy(pool, kv, cpu, disk, offload, remote=remote, offload_answers=offload_answers)
    return KVCacheManager(hierarchy, HASHER, BS)


_ids = iter(range(1_000_000))


def computed_blocks(kv: KVCacheManager, req: Request):
    """The request's cached prefix, waiting for its load from a lower tier to land."""
    while (computed := kv.get_computed_blocks(req)) is None:
        kv.wait_for_loads(timeout=5.0)
    return computed


def run_request(kv: KVCacheManager, tokens: list[int], finish: bool = True) -> Request:
    """Admit a request, 'compute' its uncached blocks, write them down, optionally finish it."""
    req = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=1, temperature=0))
    blocks, num_cached, by_tier = computed_blocks(kv, req)
    # Every cached block must already hold exactly its content.
    for block, h in zip(blocks, req.block_hashes):
        assert torch.equal(as_bytes(kv.hierarchy.kv_cache[block.block_id]), content_for(h)), "wrong bytes served"
    assert kv.allocate_slots(req, req.num_tokens - num_cached, blocks) is not None
    assert req.cached_tokens_by_tier == by_tier  # admitted with its prefix: what it reports
    for block, h in zip(kv.states[req.request_id].blocks, req.block_hashes):
        if block not in blocks:
            as_bytes(kv.hierarchy.kv_cache[block.block_id]).copy_(content_for(h))
    req.num_computed_tokens = req.num_tokens
    kv.hierarchy.flush_pending()
    kv.hierarchy.wait_for_write_downs()  # they run in the background: let them land
    if finish:
        kv.free(req)
    return req


def decode(kv: KVCacheManager, req: Request, tokens: list[int]) -> None:
    """Generate `tokens` one step each, as the scheduler drives a decode: a block the step fills is cached, given its
    content, and written down (as the policy says) once the step is over."""
    for token in tokens:
        req.output_token_ids.append(token)
        assert kv.allocate_slots(req, 1) is not None
        for block, h in zip(kv.states[req.request_id].blocks, req.block_hashes):
            as_bytes(kv.hierarchy.kv_cache[block.block_id]).copy_(content_for(h))
        req.num_computed_tokens += 1
        kv.hierarchy.flush_pending()
    kv.hierarchy.wait_for_write_downs()


def held_below(kv: KVCacheManager, block_hashes) -> list[bool]:
    return [any(tier.contains(h) for tier in kv.hierarchy.lower_tiers) for h in block_hashes]


def doc(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def test_repeat_request_hits_device_and_caps_at_last_token():
    kv = make_stack(device_blocks=16)
    tokens = doc(1, 4 * BS)  # exactly 4 full blocks
    first = run_request(kv, tokens)
    assert first.cached_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 0, "remote": 0}
    second = run_request(kv, tokens)
    # the last token is always computed, so the 4th block cannot be a hit
    assert second.cached_tokens_by_tier == {"device": 3 * BS, "cpu": 0, "disk": 0, "remote": 0}


def test_write_through_serves_an_evicted_document_from_cpu():
    kv = make_stack(device_blocks=8, cpu_blocks=32)
    a, b = doc(1, 6 * BS + 1), doc(2, 6 * BS + 1)
    run_request(kv, a)
    assert kv.hierarchy.cpu.stats().used_blocks == 6  # written through after the step
    run_request(kv, b)  # needs 7 blocks of 8: evicts most of a's device blocks
    again = run_request(kv, a)
    assert again.cached_tokens_by_tier["cpu"] > 0
    assert again.num_cached_tokens == 6 * BS
    assert kv.hierarchy.counters.promotions["cpu"] == again.cached_tokens_by_tier["cpu"] // BS


def test_a_document_wholly_in_the_cpu_tier_is_lent_out_of_its_slab_not_read_into_a_buffer(monkeypatch):
    kv = make_stack(device_blocks=8, cpu_blocks=32)
    a, b = doc(1, 6 * BS + 1), doc(2, 6 * BS + 1)
    run_request(kv, a)
    run_request(kv, b)  # evicts a's device blocks; a stays whole in the CPU tier
    monkeypatch.setattr(kv.hierarchy.cpu, "get", lambda *args: pytest.fail("read into a buffer, not lent"))
    again = run_request(kv, a)
    assert again.cached_tokens_by_tier["cpu"] > 0 and again.num_cached_tokens == 6 * BS
    for h in HASHER.hash(a)[:6]:  # each block landed with its own bytes
        block = kv.hierarchy.pool.get_cached_block(h)
        assert torch.equal(as_bytes(kv.hierarchy.kv_cache[block.block_id]), content_for(h))


def test_a_load_takes_device_blocks_in_ascending_ids_so_a_run_of_slab_rows_is_one_copy(monkeypatch):
    """A request's blocks go back to the free queue tail first, and a load takes blocks off it in that order: given
    to a document's blocks as they came, descending ids met ascending slab rows, a copy per block (443 for a
    7k-token document, each a CUDA copy launched on the transfer thread)."""
    from kvstrata.tiers import transfer

    kv = make_stack(device_blocks=8, cpu_blocks=32)
    hierarchy, pool = kv.hierarchy, kv.hierarchy.pool
    tokens = doc(1, 6 * BS + 1)
    hashes = HASHER.hash(tokens)[:6]
    block_tokens = [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(6)]
    hierarchy.cpu.put(hashes, block_tokens, [content_for(h) for h in hashes])  # neighbouring slab rows
    taken = pool.get_new_blocks(8)
    pool.free_blocks(list(reversed(taken)))  # as a finished request frees its blocks: the queue now runs 7, 6, ... 0
    copies = []
    copy_each = transfer.copy_each
    monkeypatch.setattr(transfer, "copy_each",
                        lambda dests, srcs, *args: copies.append(len(dests)) or copy_each(dests, srcs, *args))
    load = hierarchy.acquire_prefix(hashes, block_tokens)
    assert load.transfer.wait(5.0)
    ids = [load.blocks[k].block_id for k in load.below]
    assert ids == sorted(ids) == [2, 3, 4, 5, 6, 7]
    assert copies == [1]
    hit = hierarchy.finish_prefix(load)
    assert hit.tiers == ["cpu"] * 6
    for block, h in zip(hit.blocks, hashes):
        assert torch.equal(as_bytes(hierarchy.kv_cache[block.block_id]), content_for(h))


def test_on_evict_copies_down_only_when_the_device_reuses_a_block():
    kv = make_stack(device_blocks=8, cpu_blocks=32, offload="on_evict")
    a, b = doc(1, 6 * BS + 1), doc(2, 6 * BS + 1)
    run_request(kv, a)
    assert kv.hierarchy.cpu.stats().used_blocks == 0
    run_request(kv, b)
    evicted = kv.hierarchy.counters.device_evictions
    assert evicted > 0 and kv.hierarchy.cpu.stats().used_blocks == evicted
    again = run_request(kv, a)
    assert again.num_cached_tokens == 6 * BS


@pytest.mark.parametrize("offload", ["write_through", "on_evict"])
def test_a_device_cache_reset_leaves_the_blocks_below_where_the_next_request_finds_them(offload):
    kv = make_stack(device_blocks=16, cpu_blocks=32, offload=offload)
    a = doc(3, 6 * BS + 1)
    held = run_request(kv, a, finish=False)
    assert not kv.hierarchy.clear_device_cache()  # a request holds its blocks: nothing changes
    assert kv.pool.get_cached_block(held.block_hashes[0]) is not None
    kv.free(held)
    assert kv.hierarchy.clear_device_cache()
    assert not kv.pool.cached_block_hash_to_block and kv.hierarchy.cpu.stats().used_blocks == 6
    again = run_request(kv, a)  # run_request checks every served block's bytes
    assert again.cached_tokens_by_tier["cpu"] == 6 * BS


def documents_evicted_to_disk(tmp_path) -> tuple[KVCacheManager, list[list[int]]]:
    """A stack whose CPU tier holds one 6-block document, and four documents computed on it: the first is long
    gone from the device and the CPU tier, on disk only (committed)."""
    kv = make_stack(device_blocks=8, cpu_blocks=6, disk_path=tmp_path / "kv", disk_blocks=64)
    docs = [doc(i, 6 * BS + 1) for i in range(4)]
    for d in docs:
        run_request(kv, d)
    kv.hierarchy.disk.flush()
    return kv, docs


def test_cpu_evictions_cascade_to_disk_and_disk_hits_refill_cpu(tmp_path):
    kv, docs = documents_evicted_to_disk(tmp_path)
    h = kv.hierarchy
    assert h.disk.stats().used_blocks > 0
    again = run_request(kv, docs[0])  # long gone from device and CPU
    assert again.cached_tokens_by_tier["disk"] > 0
    assert again.num_cached_tokens == 6 * BS
    # blocks that came up from disk were put in the CPU tier too (it holds exactly these 6 now)
    assert all(h.cpu.contains(x) for x in again.block_hashes[:6])


def test_the_disk_keeps_a_document_read_back_from_it_over_colder_ones_that_left_the_cpu_tier_before_it(tmp_path):
    """The disk's LRU order is the order blocks left the CPU tier, those it held already too: a document read back
    from disk and used since must not be evicted before colder ones that the CPU tier let go earlier."""
    kv = make_stack(device_blocks=8, cpu_blocks=6, disk_path=tmp_path / "kv", disk_records=18)  # 3 documents
    h = kv.hierarchy
    a, b, c, d, e, f = (doc(50 + i, 6 * BS + 1) for i in range(6))
    for tokens in (a, b, c):
        run_request(kv, tokens)  # the CPU tier holds one document: a, then b, left it for disk
    assert run_request(kv, a).cached_tokens_by_tier["disk"] == 6 * BS  # read back: the CPU tier lets c go
    for tokens in (d, e, f):  # the CPU tier lets a go (the disk holds it), then d, then e; b and c are the coldest
        run_request(kv, tokens)
    h.disk.flush()
    held = {name: all(h.disk.contains(x) for x in HASHER.hash(tokens))
            for name, tokens in zip("abcde", (a, b, c, d, e))}
    assert held == {"a": True, "b": False, "c": False, "d": True, "e": True}
    assert run_request(kv, a).cached_tokens_by_tier["disk"] == 6 * BS


def test_a_disk_hit_lands_before_its_blocks_are_copied_into_the_cpu_tier(tmp_path):
    """Putting the blocks a load read from disk into the CPU tier (and the evictions to disk that cascades into)
    is off the load's path: a CPU tier that takes its time does not delay the hit."""
    kv, docs = documents_evicted_to_disk(tmp_path)
    h = kv.hierarchy
    gate, cpu_put = threading.Event(), h.cpu.put

    def slow_put(*args, **kwargs):
        assert gate.wait(10)
        return cpu_put(*args, **kwargs)

    h.cpu.put = slow_put
    try:
        req = Request("held-up", list(docs[0]), SamplingParams(max_tokens=1, temperature=0))
        blocks, num_cached, by_tier = computed_blocks(kv, req)  # landed while every CPU-tier put waits
        assert by_tier["disk"] == 6 * BS and num_cached == 6 * BS
        for block, block_hash in zip(blocks, req.block_hashes):
            assert torch.equal(as_bytes(h.kv_cache[block.block_id]), content_for(block_hash))
        assert not any(h.cpu.contains(x) for x in req.block_hashes[:6])
    finally:
        gate.set()
    h.wait_for_write_downs()
    assert all(h.cpu.contains(x) for x in req.block_hashes[:6])  # then copied up, for the next request


def test_clearing_every_tier_forgets_every_block_and_pin_and_says_which_tier_it_could_not_reach(tmp_path):
    from valkey_server import ValkeyServer
    with ValkeyServer() as server:
        kv = make_stack(device_blocks=16, cpu_blocks=32, disk_path=tmp_path / "kv", disk_blocks=32,
                        remote_url=server.url)
        h = kv.hierarchy
        a = doc(7, 6 * BS + 1)
        held = run_request(kv, a, finish=False)
        h.pin("doc-a", held.block_hashes[:6], [a[k * BS:(k + 1) * BS] for k in range(6)], {})
        h.disk.flush(), h.remote.flush()
        assert h.clear_every_tier() is None  # a request holds its blocks: nothing changes
        assert all(t.count_prefix(held.block_hashes[:6]) == 6 for t in h.lower_tiers)
        kv.free(held)
        assert h.clear_every_tier() == []
        assert not kv.pool.cached_block_hash_to_block
        assert [t.count_prefix(held.block_hashes[:6]) for t in h.lower_tiers] == [0, 0, 0]
        assert h.pins() == {} and all(t.stats().pinned_blocks == 0 for t in h.lower_tiers if t.keeps_pins)
        assert run_request(kv, a).num_cached_tokens == 0
        server.kill()  # the remote tier cannot be reached: the others are cleared all the same
        assert h.clear_every_tier() == ["remote"]
        assert [t.count_prefix(held.block_hashes[:6]) for t in h.lower_tiers[:2]] == [0, 0]
        h.close()


@pytest.mark.parametrize("replica_a_cpu_blocks", [32, 0], ids=["through-cpu", "no-cpu-tier"])
def test_a_document_one_replica_computed_is_a_remote_hit_on_another_and_lands_in_its_cpu_tier(replica_a_cpu_blocks):
    from valkey_server import ValkeyServer
    with ValkeyServer() as server:
        a = make_stack(device_blocks=16, cpu_blocks=replica_a_cpu_blocks, remote_url=server.url)
        b = make_stack(device_blocks=16, cpu_blocks=32, remote_url=server.url)
        document = doc(5, 6 * BS + 1)
        run_request(a, document)
        a.hierarchy.remote.flush()
        assert a.hierarchy.counters.write_downs["remote"] == 6
        again = run_request(b, document)  # run_request checks every served block byte for byte
        assert again.cached_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 0, "remote": 6 * BS}
        assert b.hierarchy.counters.promotions["remote"] == 6
        assert all(b.hierarchy.cpu.contains(h) for h in again.block_hashes[:6])  # the next miss is local
        server.kill()  # the server gone: a new document is recomputed, nothing raises
        other = run_request(b, doc(6, 6 * BS + 1))
        assert other.num_cached_tokens == 0
        for stack in (a, b):
            stack.hierarchy.close()


def test_a_long_document_written_through_in_one_burst_reaches_the_server_whole():
    """A long prompt's blocks are handed to the remote tier as fast as they are computed (on a GPU, faster than a
    server takes them): the write queue holds the burst, so another replica finds the whole document, not the part
    that fitted a queue of a few blocks (a block lost breaks the chain there for every replica)."""
    from valkey_server import ValkeyServer
    num_blocks = 600
    with ValkeyServer() as server:
        a = make_stack(device_blocks=num_blocks + 8, remote_url=server.url)
        b = make_stack(device_blocks=num_blocks + 8, remote_url=server.url)
        document = doc(21, num_blocks * BS + 1)
        run_request(a, document)
        a.hierarchy.wait_for_write_downs()
        a.hierarchy.remote.flush()
        assert a.hierarchy.remote.stats().extra["dropped_puts"] == 0
        again = run_request(b, document)  # every served block checked byte for byte
        assert again.cached_tokens_by_tier["remote"] == num_blocks * BS
        for stack in (a, b):
            stack.hierarchy.close()


def test_lookup_stops_at_the_first_block_no_tier_holds():
    kv = make_stack(device_blocks=16, cpu_blocks=16)
    base = doc(3, 6 * BS)
    run_request(kv, base + [7])
    h = kv.hierarchy
    req = Request("probe", base + [7], SamplingParams(max_tokens=1))
    kv._update_hashes(req)
    victim = req.block_hashes[2]
    # drop block 2 everywhere: the walk must stop there even though 3.. are still held
    block = h.pool.get_cached_block(victim)
    h.pool.cached_block_hash_to_block.pop(victim)
    block.block_hash = None
    h.cpu.discard(victim)
    assert h.locate(req.block_hashes) == ["device", "device"]


def test_a_chain_alternating_between_the_device_and_a_lower_tier_is_located_run_by_run_and_relocated_on_the_device():
    kv = make_stack(device_blocks=32, cpu_blocks=32)
    h = kv.hierarchy
    hashes = run_request(kv, doc(31, 6 * BS) + [1]).block_hashes[:6]  # on the device, written through to the CPU tier
    h.flush_pending()
    h.wait_for_write_downs()

    def leave_device(k: int) -> None:
        block = h.pool.cached_block_hash_to_block.pop(hashes[k])
        block.block_hash = None

    for k in (2, 3, 5):
        leave_device(k)
    found = h.locate(hashes)
    assert found == ["device", "device", "cpu", "cpu", "device", "cpu"]
    assert h.relocate_on_device(hashes, found) == found
    leave_device(4)  # the device no longer holds a block the earlier lookup found there: the prefix ends before it
    assert h.relocate_on_device(hashes, found) == ["device", "device", "cpu", "cpu"]
    assert h.relocate_on_device(hashes, found[:3]) == ["device", "device", "cpu"]  # nothing known past the lookup
    assert h.locate(hashes) == ["device", "device", "cpu", "cpu", "cpu", "cpu"]
    assert h.locate(hashes[:2]) == ["device", "device"] and h.locate([]) == []


def test_many_chains_are_located_together_asking_each_tier_once_with_the_answers_of_one_at_a_time(tmp_path,
                                                                                                     monkeypatch):
    from valkey_server import ValkeyServer
    with ValkeyServer() as server:
        kv = make_stack(device_blocks=16, cpu_blocks=32, disk_path=tmp_path, disk_blocks=32, remote_url=server.url)
        h = kv.hierarchy
        docs = [doc(seed, 4 * BS) + [7] for seed in (11, 12, 13, 14)]
        chains = [run_request(kv, d).block_hashes[:4] for d in docs[:3]]
        h.persist()
        h.remote.flush()
        assert h.clear_device_cache()
        run_request(kv, docs[0])                      # the first document on the device again
        for block_hash in chains[1][:2]:              # the second: its head on disk only, its tail on the server
            h.cpu.discard(block_hash)
        for block_hash in chains[1][2:]:
            h.cpu.discard(block_hash)
            h.disk.discard(block_hash)
        for block_hash in chains[2]:                  # the third: on the server only
            h.cpu.discard(block_hash)
            h.disk.discard(block_hash)
        unknown = HASHER.hash(docs[3])[:4]            # the fourth was never computed
        asked = {tier.name: [] for tier in h.lower_tiers}
        for tier in h.lower_tiers:
            def count_prefixes(chains, tier=tier, real=tier.count_prefixes):
                asked[tier.name].append(len(chains))
                return real(chains)
            monkeypatch.setattr(tier, "count_prefixes", count_prefixes)
        together = h.locate_many([*chains, unknown, []])
        assert asked == {"cpu": [3], "disk": [3], "remote": [3]}  # one question per tier for all the chains
        assert together == [["device"] * 4, ["disk", "disk", "remote", "remote"], ["remote"] * 4, [], []]
        assert together == [h.locate(chain) for chain in [*chains, unknown, []]]
        h.close()


def test_an_admission_starts_from_the_lookup_that_priced_it_unless_a_block_it_found_on_the_device_has_left():
    kv = make_stack(device_blocks=32, cpu_blocks=32)
    kv.load_policy = "always_load"
    document = doc(21, 6 * BS)
    run_request(kv, document + [1])  # cached on the device, written through to the CPU tier
    pool = kv.hierarchy.pool
    first, second = (Request(name, document + [2], SamplingParams(max_tokens=1)) for name in ("first", "second"))
    assert kv.estimate_uncached_many([first, second])[0].hit_blocks["device"] == 6  # a lookup for ordering
    locate = kv.hierarchy.locate
    asked = []
    kv.hierarchy.locate = lambda hashes: (asked.append(hashes), locate(hashes))[1]
    assert computed_blocks(kv, first)[2]["device"] == 6 * BS and not asked  # admitted on it: nothing asked again
    kv.free(first)
    gone = pool.get_cached_block(second.block_hashes[0])  # the document's first block leaves the device
    pool.cached_block_hash_to_block.pop(gone.block_hash)
    gone.block_hash = None
    # a lookup of its own: the first block is in the CPU tier, where the earlier lookup would have ended the prefix
    assert computed_blocks(kv, second)[2] == {"device": 5 * BS, "cpu": BS, "disk": 0, "remote": 0}
    assert asked == [second.block_hashes[:6]]
    kv.hierarchy.close()


def test_corrupt_lower_tier_block_ends_the_prefix_and_is_never_served():
    kv = make_stack(device_blocks=8, cpu_blocks=32)
    a, b = doc(1, 6 * BS + 1), doc(2, 6 * BS + 1)
    run_request(kv, a)
    run_request(kv, b)
    h = kv.hierarchy
    probe = Request("p", list(a), SamplingParams(max_tokens=1))
    kv._update_hashes(probe)
    where = h.locate(probe.block_hashes[:6])
    first_cpu = where.index("cpu")
    # overwrite the stored token ids check: store the block again under its hash with wrong tokens
    h.cpu.discard(probe.block_hashes[first_cpu])
    h.cpu.put([probe.block_hashes[first_cpu]], [[9999] * BS], [content_for(b"x" * 16)])
    again = run_request(kv, a)  # run_request asserts every served block holds the right bytes
    assert again.num_cached_tokens == first_cpu * BS
    assert h.cpu.stats().corrupt == 1


def test_pending_write_through_is_written_before_its_block_is_reused():
    kv = make_stack(device_blocks=8, cpu_blocks=32)
    h = kv.hierarchy
    a = doc(5, 6 * BS + 1)
    req = run_request(kv, a, finish=False)
    # queue the write-downs again as if the step had not been flushed yet, then force reuse
    for k, block in enumerate(kv.states[req.request_id].blocks[:6]):
        h.policy.pending[block.block_id] = block.block_hash
    h.cpu.clear()
    kv.free(req)
    run_request(kv, doc(6, 7 * BS + 1))  # reuses a's blocks before any flush
    reused = [x for x in req.block_hashes[:6] if h.pool.get_cached_block(x) is None]
    assert len(reused) >= 5  # b's 8 blocks took all but at most one of a's
    assert all(h.cpu.contains(x) for x in reused)
    assert run_request(kv, a).num_cached_tokens == 6 * BS


def test_cache_salt_isolates_tenants():
    kv = make_stack(device_blocks=16)
    tokens = doc(8, 4 * BS + 1)
    run_request(kv, tokens)
    salted = Request("s", list(tokens), SamplingParams(max_tokens=1), cache_salt="tenant-b")
    blocks, n, _ = kv.get_computed_blocks(salted)
    assert n == 0 and blocks == []


def test_reference_scenario_through_the_manager():
    """DESIGN's reference scenario, driven through KVCacheManager as the scheduler drives it."""
    kv = make_stack(device_blocks=10)
    pool = kv.pool
    queue = lambda: [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]  # noqa: E731

    r0 = Request("r0", list(range(15)), SamplingParams(max_tokens=8))
    blocks, n, _ = kv.get_computed_blocks(r0)
    kv.allocate_slots(r0, 15, blocks)
    r0.num_computed_tokens = 15
    assert list(kv.get_block_ids(r0)) == [0, 1, 2, 3]
    assert [pool.blocks[i].block_hash is not None for i in range(4)] == [True, True, True, False]

    r0.output_token_ids.append(15)  # decode one token: block 3 becomes full
    kv.allocate_slots(r0, 1)
    r0.num_computed_tokens = 16
    assert pool.blocks[3].block_hash is not None
    r0.output_token_ids.append(16)
    kv.allocate_slots(r0, 1)
    r0.num_computed_tokens = 17
    assert list(kv.get_block_ids(r0)) == [0, 1, 2, 3, 4]

    r1 = Request("r1", list(range(10)) + [100, 101, 102, 103], SamplingParams(max_tokens=8))
    blocks, n, _ = kv.get_computed_blocks(r1)
    assert n == 8 and [b.block_id for b in blocks] == [0, 1]
    kv.allocate_slots(r1, 14 - 8, blocks)
    assert list(kv.get_block_ids(r1)) == [0, 1, 5, 6]

    kv.free(r0)
    assert queue() == [7, 8, 9, 4, 3, 2]
    assert pool.blocks[2].block_hash is not None and pool.blocks[3].block_hash is not None
    kv.free(r1)
    assert queue() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    r2 = Request("r2", list(range(12)) + list(range(200, 217)), SamplingParams(max_tokens=1))
    blocks, n, _ = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0, 1, 2] and n == 12
    assert queue() == [7, 8, 9, 4, 3, 6, 5]
    old_hash_3 = pool.blocks[3].block_hash
    kv.allocate_slots(r2, 29 - 12, blocks)
    assert list(kv.get_block_ids(r2)) == [0, 1, 2, 7, 8, 9, 4, 3]
    assert pool.get_cached_block(old_hash_3) is None

    # preempted (freed) and scheduled again: its ids are its new blocks', not those it held before
    kv.free(r2)
    r2.num_computed_tokens = 0
    blocks, n, _ = kv.get_computed_blocks(r2)
    kv.allocate_slots(r2, 29 - n, blocks)
    assert list(kv.get_block_ids(r2)) == [b.block_id for b in kv.states["r2"].blocks]
    assert list(kv.get_block_ids(r2))[:len(blocks)] == [b.block_id for b in blocks]


def test_blocks_persisted_on_close_are_disk_hits_in_a_new_process(tmp_path):
    kv = make_stack(device_blocks=16, cpu_blocks=16, disk_path=tmp_path / "kv", disk_blocks=64)
    tokens = doc(11, 5 * BS + 1)
    req = run_request(kv, tokens)
    kv.hierarchy.close()
    # A fresh interpreter: same hashes (no Python hash()), blocks found on disk with the right bytes.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        import test_hierarchy as t
        kv = t.make_stack(device_blocks=16, cpu_blocks=16, disk_path={str(tmp_path / 'kv')!r}, disk_blocks=64)
        r = t.run_request(kv, t.doc(11, 5 * t.BS + 1))
        print(r.cached_tokens_by_tier["disk"])
        kv.hierarchy.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) == 5 * BS
    assert req.cached_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 0, "remote": 0}  # the first process computed it


def test_a_process_that_exits_without_closing_still_writes_its_cached_blocks_down_without_a_traceback(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        import test_hierarchy as t
        kv = t.make_stack(device_blocks=64, cpu_blocks=4, disk_path={str(tmp_path / 'kv')!r}, disk_blocks=64)
        for seed in range(6):  # write-throughs still in flight at exit, the small CPU tier evicting to disk
            t.run_request(kv, t.doc(seed, 5 * t.BS + 1))
        # no close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    kv = make_stack(device_blocks=64, disk_path=tmp_path / "kv", disk_blocks=64)
    for seed in range(6):
        assert run_request(kv, doc(seed, 5 * BS + 1)).cached_tokens_by_tier["disk"] == 5 * BS
    kv.hierarchy.close()


def test_idle_write_down_in_chunks_puts_every_cached_block_on_disk(tmp_path):
    kv = make_stack(device_blocks=16, cpu_blocks=6, disk_path=tmp_path / "kv", disk_blocks=64)
    a, b = doc(21, 5 * BS + 1), doc(22, 5 * BS + 1)
    ra, rb = run_request(kv, a), run_request(kv, b)
    h = kv.hierarchy
    chunks = []
    while (n := h.persist(max_blocks=3, wait=False)) > 0:
        assert n <= 3
        chunks.append(n)
    h.wait_for_write_downs()  # device blocks go down in store jobs, off the caller's thread
    h.disk.flush()
    assert len(chunks) >= 2  # (some blocks already cascaded to disk through the small CPU tier)
    for x in ra.block_hashes[:5] + rb.block_hashes[:5]:
        assert h.disk.contains(x)
    assert h.persist(max_blocks=3) == 0  # nothing new cached: nothing to do
    run_request(kv, doc(23, 3 * BS + 1))
    assert h.persist() == 3  # only the new blocks


def test_persist_copies_device_blocks_off_the_device_in_one_store_job_per_batch(tmp_path):
    """A write-down at close or when idle moves device blocks as write-through does: one batched copy
    per batch on the transfer worker (on a GPU, not a copy and a sync per block on the step thread)."""
    kv = make_stack(device_blocks=16, disk_path=tmp_path / "kv", disk_blocks=64, offload="on_evict")
    h = kv.hierarchy  # on_evict: nothing was written down, every cached block is on the device only
    req = run_request(kv, doc(31, 5 * BS + 1))
    jobs = []
    store = h.transfers.store
    h.transfers.store = lambda block_ids, drain: jobs.append(list(block_ids)) or store(block_ids, drain)
    assert h.persist() == 5
    assert len(jobs) == 1 and len(jobs[0]) == 5
    for block_hash in req.block_hashes[:5]:
        assert h.disk.contains(block_hash)
    assert h.counters.write_downs["disk"] == 5


def test_pin_copies_device_blocks_in_one_store_job_and_reads_another_tier_once(tmp_path):
    """Pinning a document copies what each lower tier lacks in batches: the device's blocks in one
    store job per tier (not a copy and a sync per block on the caller's thread), another tier's in
    one read; the pinned blocks then hold exactly their content."""
    kv = make_stack(device_blocks=16, cpu_blocks=12, disk_path=tmp_path / "kv", disk_blocks=64, offload="on_evict")
    h = kv.hierarchy  # on_evict: every cached block is on the device only
    tokens = doc(41, 5 * BS + 1)
    req = run_request(kv, tokens)
    hashes, block_tokens = req.block_hashes[:5], [tokens[k * BS:(k + 1) * BS] for k in range(5)]
    jobs, disk_reads = [], []
    store, disk_get = h.transfers.store, h.disk.get
    h.transfers.store = lambda block_ids, drain: jobs.append(list(block_ids)) or store(block_ids, drain)
    h.disk.get = lambda *args: disk_reads.append(len(args[0])) or disk_get(*args)
    h.pin("doc", hashes, block_tokens, {})
    assert [len(job) for job in jobs] == [5, 5]  # one job for the CPU tier, one for the disk tier
    assert disk_reads == []
    for tier in (h.cpu, h.disk):
        assert set(tier.pins()["doc"].block_hashes) == set(hashes)
        for block_hash, toks in zip(hashes, block_tokens):
            dest = torch.empty(LAYOUT.block_nbytes, dtype=torch.uint8)
            assert tier.get([block_hash], [toks], [dest]) == [True]
            assert torch.equal(dest, content_for(block_hash))

    assert h.clear_device_cache()  # on_evict writes them down to the CPU tier, as eviction would
    h.cpu.clear()  # the blocks are on disk only now
    jobs.clear(), disk_reads.clear()
    h.pin("doc2", hashes, block_tokens, {})
    assert jobs == [] and disk_reads == [5]  # the CPU tier's copies come from disk in one read
    for block_hash in hashes:
        assert h.cpu.contains(block_hash)


def test_a_promotion_never_evicts_a_device_hit_later_in_the_same_prefix():
    """Prefix laid out device, cpu, cpu, device, device, device: the promotions' allocations must not
    take the later device hits' blocks (they are held before anything is allocated)."""
    kv = make_stack(device_blocks=7, cpu_blocks=32)
    h = kv.hierarchy
    tokens = doc(31, 6 * BS + 1)
    first = run_request(kv, tokens)
    for x in first.block_hashes[1:3]:  # blocks 1 and 2 leave the device; the CPU tier still has them
        block = h.pool.cached_block_hash_to_block.pop(x)
        block.block_hash = None
    assert h.locate(first.block_hashes[:6]) == ["device", "cpu", "cpu", "device", "device", "device"]
    again = run_request(kv, tokens)  # checks every served block's bytes
    assert again.cached_tokens_by_tier == {"device": 4 * BS, "cpu": 2 * BS, "disk": 0, "remote": 0}

    # the same layout with block 1 corrupt in the CPU tier: the prefix ends after block 0 and the
    # device hits further along are not left held
    for x in first.block_hashes[1:3]:
        block = h.pool.cached_block_hash_to_block.pop(x)
        block.block_hash = None
    h.cpu.discard(first.block_hashes[1])
    h.cpu.put([first.block_hashes[1]], [[9999] * BS], [content_for(first.block_hashes[1])])
    probe = Request("probe", list(tokens), SamplingParams(max_tokens=1))
    blocks, num_cached, _ = computed_blocks(kv, probe)
    assert num_cached == BS and len(blocks) == 1
    assert all(h.pool.get_cached_block(x).ref_cnt == 0 for x in first.block_hashes[3:6])
    # held: block 0, and the block reserved for the prompt's last token when the load started
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1 - len(kv.states[probe.request_id].reserved)


@pytest.mark.parametrize("offload", ["write_through", "on_evict"])
def test_an_answer_stays_on_the_device_until_a_later_prompt_reuses_it(tmp_path, offload):
    """A block holding a generated token is cached on the device but written down by neither policy, nor by persist:
    in long-document QA an answer is asked for once, and below it would take the room of documents asked about
    again. A later prompt that reuses it (a chat's next turn) makes it a prompt block, written down as one."""
    kv = make_stack(device_blocks=12, cpu_blocks=64, disk_path=tmp_path / "disk", disk_blocks=64, offload=offload)
    prompt, answer = doc(31, 2 * BS + 1), doc(32, 2 * BS + 3)
    req = run_request(kv, prompt, finish=False)
    decode(kv, req, answer)  # fills the prompt's last block and two more: all three hold generated tokens
    kv.free(req)
    prompt_blocks, answer_blocks = req.block_hashes[:2], req.block_hashes[2:5]
    assert kv.pool.get_cached_block(answer_blocks[2]) is not None  # cached on the device: a later turn finds it
    kv.hierarchy.persist()
    run_request(kv, doc(33, 11 * BS + 1))  # takes every device block: the answers' slots are reused
    assert kv.pool.get_cached_block(answer_blocks[0]) is None
    assert held_below(kv, prompt_blocks) == [True, True]
    assert held_below(kv, answer_blocks) == [False] * 3

    kv = make_stack(device_blocks=16, cpu_blocks=64, offload=offload)
    req = run_request(kv, prompt, finish=False)
    decode(kv, req, answer)
    kv.free(req)
    next_turn = run_request(kv, prompt + answer + doc(34, BS))
    assert next_turn.cached_tokens_by_tier["device"] == 5 * BS  # the answer reused from the device
    run_request(kv, doc(35, 15 * BS + 1))  # evicts them all (on_evict writes down what leaves the device)
    kv.hierarchy.wait_for_write_downs()
    assert held_below(kv, req.block_hashes[:5]) == [True] * 5
    again = run_request(kv, prompt + answer + doc(36, BS))
    assert again.cached_tokens_by_tier["cpu"] == 5 * BS  # served, content checked, from the CPU tier


def test_offload_answers_writes_generated_blocks_down_as_they_fill():
    kv = make_stack(device_blocks=16, cpu_blocks=64, offload_answers=True)
    req = run_request(kv, doc(37, 2 * BS + 1), finish=False)
    decode(kv, req, doc(38, 2 * BS + 3))
    assert held_below(kv, req.block_hashes[:5]) == [True] * 5


def test_a_preempted_request_finding_its_own_answer_again_does_not_write_it_down():
    """Readmitted after a preemption, a request finds the blocks of its own answer on the device: that is no later
    prompt reusing them, and they stay on the device."""
    kv = make_stack(device_blocks=16, cpu_blocks=64)
    req = run_request(kv, doc(39, 2 * BS + 1), finish=False)
    decode(kv, req, doc(40, 2 * BS + 3))
    kv.free(req)  # preempted, as the scheduler does: its blocks go back, still cached, and it starts over
    req.num_computed_tokens = 0
    blocks, num_cached, _ = computed_blocks(kv, req)
    assert num_cached == 4 * BS  # its prompt's two blocks and two of its answer's (the last token is computed)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, blocks) is not None
    kv.hierarchy.flush_pending()
    kv.hierarchy.wait_for_write_downs()
    assert held_below(kv, req.block_hashes[:5]) == [True, True, False, False, False]
