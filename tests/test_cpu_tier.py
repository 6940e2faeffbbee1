"""The CPU tier serves back exactly what was put, evicts least recently used blocks through
`on_evict` before reusing their slots, and never serves a block stored under other tokens."""
import threading

import pytest
import torch
from tier_cases import BF16, FP32, key, payload, tokens

from kvstrata.tiers.cpu import CpuTier


def put_blocks(tier: CpuTier, ids, layout=BF16) -> dict[int, torch.Tensor]:
    blocks = {i: payload(layout, i) for i in ids}
    tier.put([key(i) for i in ids], [tokens(i, layout) for i in ids], [blocks[i] for i in ids])
    return blocks


def get_one(tier: CpuTier, i: int, layout=BF16, toks=None) -> torch.Tensor | None:
    dest = torch.empty(layout.block_nbytes, dtype=torch.uint8)
    (ok,) = tier.get([key(i)], [toks if toks is not None else tokens(i, layout)], [dest])
    return dest if ok else None


@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_put_then_get_returns_identical_bytes(layout):
    tier = CpuTier(layout, capacity_blocks=4)
    blocks = put_blocks(tier, [1, 2, 3], layout)
    dests = [torch.empty(layout.block_nbytes, dtype=torch.uint8) for _ in range(3)]
    assert tier.get([key(i) for i in (1, 2, 3)], [tokens(i, layout) for i in (1, 2, 3)], dests) == [True] * 3
    for i, dest in zip((1, 2, 3), dests):
        assert torch.equal(dest, blocks[i])


def test_caller_may_overwrite_source_after_put():
    tier = CpuTier(BF16, capacity_blocks=2)
    src = payload(BF16, 7)
    expected = src.clone()
    tier.put([key(7)], [tokens(7)], [src])
    src.zero_()
    assert torch.equal(get_one(tier, 7), expected)


def test_get_of_unknown_hash_is_a_miss():
    tier = CpuTier(BF16, capacity_blocks=2)
    put_blocks(tier, [1])
    dests = [torch.empty(BF16.block_nbytes, dtype=torch.uint8) for _ in range(2)]
    assert tier.get([key(1), key(2)], [tokens(1), tokens(2)], dests) == [True, False]


def test_full_tier_evicts_least_recently_used_and_get_refreshes_recency():
    tier = CpuTier(BF16, capacity_blocks=3)
    put_blocks(tier, [1, 2, 3])
    assert get_one(tier, 1) is not None  # 1 becomes most recent; 2 is now the oldest
    put_blocks(tier, [4])
    assert not tier.contains(key(2))
    assert all(tier.contains(key(i)) for i in (1, 3, 4))


def test_eviction_hands_the_old_payload_to_on_evict_before_its_slot_is_reused():
    evicted = []

    def on_evict(block_hash, token_ids, payload, parent):
        evicted.append((block_hash, token_ids, payload.clone(), parent))

    tier = CpuTier(BF16, capacity_blocks=2, on_evict=on_evict)
    blocks = put_blocks(tier, [1, 2])
    put_blocks(tier, [3])
    assert len(evicted) == 1
    block_hash, token_ids, payload, parent = evicted[0]
    assert block_hash == key(1)
    assert list(token_ids) == tokens(1)
    assert torch.equal(payload, blocks[1])
    assert parent is None  # put without one: the write-down below names none either


def test_token_mismatch_is_a_miss_counted_as_corrupt_and_drops_the_entry():
    tier = CpuTier(BF16, capacity_blocks=2)
    put_blocks(tier, [1])
    wrong = tokens(1)
    wrong[-1] += 1
    assert get_one(tier, 1, toks=wrong) is None
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.corrupt, stats.misses, stats.hits, stats.used_blocks) == (1, 1, 0, 0)
    put_blocks(tier, [2, 3])  # the dropped slot is free again: no eviction needed
    assert tier.stats().evictions == 0


def test_token_ids_may_come_as_a_tensor():
    tier = CpuTier(BF16, capacity_blocks=2)
    blocks = put_blocks(tier, [5])
    assert torch.equal(get_one(tier, 5, toks=torch.tensor(tokens(5))), blocks[5])


def test_put_of_a_held_hash_only_refreshes_recency():
    tier = CpuTier(BF16, capacity_blocks=2)
    blocks = put_blocks(tier, [1, 2])
    tier.put([key(1)], [tokens(1)], [payload(BF16, 99)])  # other bytes: ignored, 1 becomes recent
    assert torch.equal(get_one(tier, 1), blocks[1])
    put_blocks(tier, [3])
    assert not tier.contains(key(2)) and tier.contains(key(1))
    assert tier.stats().puts == 3


def test_a_put_keeps_a_block_that_an_earlier_block_of_the_same_put_evicted():
    evicted = []
    tier = CpuTier(BF16, capacity_blocks=3, on_evict=lambda h, *_: evicted.append(h))
    put_blocks(tier, [1, 2, 3])  # 1 is the least recently used
    blocks = put_blocks(tier, [4, 1])  # 4 evicts 1, then 1 comes back and evicts 2, as one put at a time would
    assert evicted == [key(1), key(2)]
    assert [h for h, *_ in tier.blocks()] == [key(3), key(4), key(1)]
    assert torch.equal(get_one(tier, 1), blocks[1])


def test_stats_count_hits_misses_puts_evictions_and_usage():
    tier = CpuTier(BF16, capacity_blocks=2)
    put_blocks(tier, [1, 2, 3])            # 3 evicts 1
    get_one(tier, 1)                       # miss
    get_one(tier, 2)                       # hit
    get_one(tier, 3)                       # hit
    stats = tier.stats()
    assert stats.name == "cpu"
    assert (stats.hits, stats.misses, stats.puts, stats.evictions, stats.corrupt) == (2, 1, 3, 1, 0)
    assert (stats.capacity_blocks, stats.used_blocks) == (2, 2)
    assert (stats.capacity_bytes, stats.used_bytes) == (2 * BF16.block_nbytes, 2 * BF16.block_nbytes)


def test_count_prefix_stops_at_the_first_missing_block():
    tier = CpuTier(BF16, capacity_blocks=4)
    put_blocks(tier, [1, 2, 4])
    assert tier.count_prefix([key(1), key(2), key(3), key(4)]) == 2
    assert tier.held([key(1), key(3), key(2)]) == [True, False, True]  # each, past a gap
    assert tier.count_prefix([key(3), key(1)]) == 0
    assert tier.count_prefix([]) == 0


def test_blocks_lists_every_held_block_oldest_first():
    tier = CpuTier(BF16, capacity_blocks=3)
    blocks = put_blocks(tier, [1, 2, 3])
    get_one(tier, 1)
    listed = tier.blocks()
    assert [h for h, _, _, _ in listed] == [key(2), key(3), key(1)]
    for h, toks, payload, parent in listed:
        i = int.from_bytes(h, "big")
        assert list(toks) == tokens(i) and torch.equal(payload, blocks[i]) and parent is None


def test_discard_and_clear_free_slots():
    tier = CpuTier(BF16, capacity_blocks=2)
    put_blocks(tier, [1, 2])
    assert tier.discard(key(1)) and not tier.discard(key(1))
    tier.clear()
    assert tier.stats().used_blocks == 0
    put_blocks(tier, [3, 4])
    assert tier.stats().evictions == 0


def test_blocks_put_after_others_were_discarded_sit_in_neighbouring_rows_lent_in_one_run():
    """A promotion lends a document's rows and copies each run of neighbours at once. Slots given back (the start-up
    probe's throwaway blocks, for one) used to come back last first: the next document's first blocks went to rows in
    descending order, a copy each (137 copies for a 437-block hit after the probe's 88 blocks)."""
    from kvstrata.tiers.transfer import contiguous_runs

    tier = CpuTier(BF16, capacity_blocks=16)
    put_blocks(tier, range(100, 106))
    for i in range(100, 106):
        tier.discard(key(i))
    put_blocks(tier, range(10))
    lent = tier.lend([key(i) for i in range(10)], [tokens(i) for i in range(10)])
    try:
        assert lent.rows == list(range(10))
        assert len(contiguous_runs(list(range(50, 60)), lent.rows)) == 1
    finally:
        lent.release()


def test_pinned_request_without_cuda_falls_back_to_plain_memory():
    tier = CpuTier(BF16, capacity_blocks=1, pin_memory=True)
    assert tier.stats().extra["pinned"] == torch.cuda.is_available()
    blocks = put_blocks(tier, [1])
    assert torch.equal(get_one(tier, 1), blocks[1])


def test_zero_capacity_is_rejected():
    with pytest.raises(ValueError, match="cache.tiers.cpu.size"):
        CpuTier(BF16, capacity_blocks=0)


def test_a_held_block_is_never_evicted_and_a_full_tier_of_held_blocks_rejects_puts():
    tier = CpuTier(BF16, capacity_blocks=2)
    put_blocks(tier, [1, 2])
    tier.hold([key(1)])
    put_blocks(tier, [3])  # evicts 2, the least recently used block not held
    assert tier.contains(key(1)) and tier.contains(key(3)) and not tier.contains(key(2))
    tier.hold([key(3)])
    put_blocks(tier, [4])  # every slot is held: the put stores nothing
    assert not tier.contains(key(4)) and tier.stats().extra["rejected_puts"] == 1
    tier.release([key(1), key(3)])
    put_blocks(tier, [4])
    assert tier.contains(key(4))


class PausedReads:
    """Stands in for the CPU tier's block copies: a copy made on the `reader` thread waits for `go`, so a
    test can act on the tier while a read is copying out of a slot (copies run outside the lock)."""

    def __init__(self, copy_each):
        self.copy_each, self.reading, self.go = copy_each, threading.Event(), threading.Event()

    def __call__(self, dests, srcs):
        if threading.current_thread().name == "reader":
            self.reading.set()
            assert self.go.wait(10)
        self.copy_each(dests, srcs)


def test_a_slot_being_read_is_neither_evicted_nor_reused_until_the_read_ends(monkeypatch):
    import kvstrata.tiers.cpu as cpu_module
    paused = PausedReads(cpu_module.copy_each)
    monkeypatch.setattr(cpu_module, "copy_each", paused)
    tier = CpuTier(BF16, capacity_blocks=2)
    blocks = put_blocks(tier, [1, 2])
    got = {}
    reader = threading.Thread(target=lambda: got.update(block=get_one(tier, 1)), name="reader")
    reader.start()
    assert paused.reading.wait(10)  # block 1 is being copied out, and is the most recently used
    put_blocks(tier, [3])           # evicts block 2, the least recently used
    put_blocks(tier, [4])           # block 1 is now the oldest, but being read: block 3 goes instead
    assert tier.contains(key(1)) and not tier.contains(key(3))
    assert tier.discard(key(1))     # dropped mid-read: its slot stays out of use until the read ends
    put_blocks(tier, [5])           # so this evicts block 4 rather than taking block 1's slot
    assert not tier.contains(key(4))
    paused.go.set()
    reader.join(10)
    assert torch.equal(got["block"], blocks[1])
    put_blocks(tier, [6])           # the read is over: block 1's slot is free again, nothing is evicted
    assert tier.contains(key(5)) and tier.contains(key(6)) and tier.stats().evictions == 3


def lent_bytes(lent) -> list[torch.Tensor]:
    return [lent.slab[row].clone() for row in lent.rows]


def test_blocks_are_lent_for_a_copy_straight_from_the_slab_and_count_as_hits():
    tier = CpuTier(BF16, capacity_blocks=4)
    blocks = put_blocks(tier, [1, 2, 3])
    lent = tier.lend([key(3), key(1)], [tokens(3), tokens(1)])
    assert [torch.equal(b, blocks[i]) for b, i in zip(lent_bytes(lent), (3, 1))] == [True, True]
    assert tier.stats().hits == 2
    lent.release()
    again = tier.lend([key(1), key(2)], [tuple(tokens(1)), tuple(tokens(2))])  # token ids as tuples, as the engine's
    assert [torch.equal(b, blocks[i]) for b, i in zip(lent_bytes(again), (1, 2))] == [True, True]
    assert tier.stats().hits == 4
    again.release()


def test_a_lend_with_a_missing_or_stale_block_lends_nothing_and_counts_nothing():
    tier = CpuTier(BF16, capacity_blocks=4)
    put_blocks(tier, [1, 2])
    assert tier.lend([key(1), key(9)], [tokens(1), tokens(9)]) is None
    assert tier.lend([key(1), key(2)], [tokens(1), tokens(5)]) is None  # block 2 stored under other tokens
    assert tier.lend([key(1), key(2)], [tuple(tokens(1)), tuple(tokens(5))]) is None  # as the engine gives them
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 0, 0)
    assert tier.contains(key(2))  # the caller's `get` is what finds it stale and drops it


def test_a_lent_slot_is_neither_evicted_nor_reused_until_released_once():
    tier = CpuTier(BF16, capacity_blocks=2)
    blocks = put_blocks(tier, [1, 2])
    lent = tier.lend([key(1)], [tokens(1)])
    put_blocks(tier, [3])           # evicts block 2
    put_blocks(tier, [4])           # block 1 is the oldest, but lent: block 3 goes instead
    assert tier.contains(key(1)) and not tier.contains(key(3))
    assert tier.discard(key(1))     # dropped while lent: its slot stays out of use until released
    put_blocks(tier, [5])
    assert not tier.contains(key(4))
    assert torch.equal(lent.slab[lent.rows[0]], blocks[1])  # the copy may still read it
    lent.release()
    lent.release()                  # a second release finds nothing left to release
    put_blocks(tier, [6])           # the slot is free again: nothing is evicted
    assert tier.contains(key(5)) and tier.contains(key(6)) and tier.stats().evictions == 3


class GatedCopies:
    """The tier's block copies, held until `gate` is set (`started` is set at the first)."""

    def __init__(self, copy_each):
        self.copy_each, self.gate, self.started = copy_each, threading.Event(), threading.Event()

    def __call__(self, dests, srcs):
        self.started.set()
        assert self.gate.wait(30), "the gate was never opened"
        self.copy_each(dests, srcs)


def test_lookups_holds_and_reads_do_not_wait_for_a_put_to_copy_its_blocks(monkeypatch):
    import kvstrata.tiers.cpu as cpu_module

    tier = CpuTier(BF16, capacity_blocks=8)
    blocks = put_blocks(tier, [1, 2])
    copies = GatedCopies(cpu_module.copy_each)
    monkeypatch.setattr(cpu_module, "copy_each", copies)
    writer = threading.Thread(target=put_blocks, args=(tier, [3, 4, 5]))
    writer.start()
    assert copies.started.wait(30)
    answers = []

    def step_path():  # what a step asks of the tier while a write-down copies
        tier.hold([key(1)])
        lent = tier.lend([key(1), key(2)], [tokens(1), tokens(2)])
        answers.extend([tier.count_prefix([key(1), key(2), key(3)]), tier.contains(key(4)), len(lent.rows)])
        lent.release()
        tier.release([key(1)])

    reader = threading.Thread(target=step_path)
    reader.start()
    reader.join(30)
    stuck = reader.is_alive()
    copies.gate.set()
    writer.join(30)
    assert not stuck, "a lookup waited for a put's copies"
    assert answers == [2, False, 2]  # blocks being written are not found until all of the put's are written
    monkeypatch.setattr(cpu_module, "copy_each", copies.copy_each)
    assert tier.count_prefix([key(i) for i in (1, 2, 3, 4, 5)]) == 5
    assert all(torch.equal(get_one(tier, i), payload(BF16, i)) for i in (3, 4, 5))
    assert torch.equal(get_one(tier, 1), blocks[1])


def test_puts_beyond_the_tiers_slots_evict_as_one_at_a_time_would_also_when_they_run_at_once():
    evicted = []
    tier = CpuTier(BF16, capacity_blocks=4, on_evict=lambda h, *_: evicted.append(int.from_bytes(h, "big")))
    put_blocks(tier, range(10))  # one put of more blocks than slots: its last blocks stay, its first are evicted
    assert evicted == list(range(6)) and tier.count_prefix([key(i) for i in range(6, 10)]) == 4
    writers = [threading.Thread(target=put_blocks, args=(tier, range(100 * w, 100 * w + 12))) for w in (1, 2, 3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(30)
    assert not any(w.is_alive() for w in writers), "puts into a full tier waited for one another for ever"
    stats = tier.stats()
    assert (stats.used_blocks, stats.puts, stats.extra["rejected_puts"]) == (4, 10 + 36, 0)
    assert len(evicted) == 6 + 36


def test_lookups_do_not_wait_for_an_eviction_handed_down_to_the_tier_below():
    gate, cascading, handed_down = threading.Event(), threading.Event(), []

    def on_evict(block_hash, token_ids, payload_view, parent):  # the disk tier's copy and checksum, held here
        cascading.set()
        assert gate.wait(30), "the gate was never opened"
        handed_down.append((int.from_bytes(block_hash, "big"), payload_view.clone()))

    tier = CpuTier(BF16, capacity_blocks=2, on_evict=on_evict)
    put_blocks(tier, [1, 2])
    writer = threading.Thread(target=put_blocks, args=(tier, [3]), daemon=True)
    writer.start()
    assert cascading.wait(30)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(tier.count_prefix([key(2), key(1)])), daemon=True)
    reader.start()
    reader.join(30)
    stuck = reader.is_alive()
    gate.set()
    writer.join(30)
    assert not stuck, "a lookup waited for an eviction's cascade"
    assert answers == [2]  # the evicted block is still found here while it goes down: no lookup misses it
    assert [i for i, _ in handed_down] == [1] and torch.equal(handed_down[0][1], payload(BF16, 1))  # before reuse
    assert torch.equal(get_one(tier, 3), payload(BF16, 3))
    assert tier.count_prefix([key(1)]) == 0  # gone once handed down


def test_a_block_lent_while_it_is_handed_down_is_not_overwritten_until_released():
    """A lookup finds a block on its way down, so a promotion may lend it then: the put that evicted it writes
    the slot only once that lend is released."""
    gate, cascading = threading.Event(), threading.Event()

    def on_evict(block_hash, token_ids, payload_view, parent):
        cascading.set()
        assert gate.wait(30), "the gate was never opened"

    tier = CpuTier(BF16, capacity_blocks=1, on_evict=on_evict)
    put_blocks(tier, [1])
    writer = threading.Thread(target=put_blocks, args=(tier, [2]), daemon=True)
    writer.start()
    assert cascading.wait(30)
    lent = tier.lend([key(1)], [tokens(1)])
    assert lent is not None  # found and lent while it goes down
    gate.set()
    writer.join(0.5)
    assert writer.is_alive(), "the put wrote a slot that is lent"
    assert torch.equal(lent.slab[lent.rows[0]], payload(BF16, 1))
    lent.release()
    writer.join(30)
    assert not writer.is_alive()
    assert tier.count_prefix([key(1)]) == 0 and torch.equal(get_one(tier, 2), payload(BF16, 2))


def test_a_block_dropped_while_handed_down_leaves_its_slot_to_the_put():
    gate, cascading = threading.Event(), threading.Event()

    def on_evict(block_hash, token_ids, payload_view, parent):
        cascading.set()
        assert gate.wait(30), "the gate was never opened"

    tier = CpuTier(BF16, capacity_blocks=2, on_evict=on_evict)
    put_blocks(tier, [1, 2])
    writer = threading.Thread(target=put_blocks, args=(tier, [3]), daemon=True)
    writer.start()
    assert cascading.wait(30)
    assert tier.clear()  # drops block 1 too, whose slot the put has taken
    gate.set()
    writer.join(30)
    put_blocks(tier, [4])  # the free slot; block 3's slot is not free twice
    assert torch.equal(get_one(tier, 3), payload(BF16, 3)) and torch.equal(get_one(tier, 4), payload(BF16, 4))
    assert tier.stats().used_blocks == 2
