"""The disk tier serves back exactly what was put, across reopen and across processes, keeps within its
byte budget by evicting the least recently read block, and turns anything that does not verify into
a counted miss instead of an exception or wrong bytes."""
import glob
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch
from tier_cases import BF16, FP32, get_blocks, key, payload, put_blocks, tokens

from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.lmdb_store import clear_store, read_store_stats
from kvstrata.tiers.record import RecordCodec

MiB = 1 << 20


def run_python(code: str) -> str:
    """Run code in a fresh interpreter (a second process on the store); returns its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


# A child process (another process on the same store) uses the same blocks, with the layout fixed.
CHILD_PRELUDE = f"""
import sys
import torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tier_cases
from tier_cases import key, tokens
from kvstrata.tiers.disk import DiskTier
L = tier_cases.BF16
def payload(i): return tier_cases.payload(L, i)
"""


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "kvstore")


def corrupt_value(path: str, i: int, mangle) -> None:
    """Rewrite one stored value directly in LMDB (the tier must be closed)."""
    env = lmdb.open(path, max_dbs=4, map_size=0)
    blocks = env.open_db(b"blocks", create=False)
    with env.begin(write=True, db=blocks) as txn:
        txn.put(key(i), mangle(bytearray(txn.get(key(i)))))
    env.close()


def stall_the_writer(tier: DiskTier) -> threading.Event:
    """Hold the writer before its next transaction until the returned event is set: what is put meanwhile queues."""
    go = threading.Event()
    commit = tier._commit

    def stalled_commit(batch):
        go.wait()
        commit(batch)

    tier._commit = stalled_commit
    return go


@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_put_then_get_returns_identical_bytes(store_path, layout):
    tier = DiskTier(layout, store_path, 4 * MiB)
    put_blocks(tier, range(5), layout)
    tier.flush()
    assert get_blocks(tier, range(5), layout) == [True] * 5
    assert get_blocks(tier, [7], layout) == [False]
    tier.close()


def test_blocks_survive_close_and_reopen(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, range(3))
    tier.close()  # flushes
    reopened = DiskTier(BF16, store_path, 4 * MiB)
    assert get_blocks(reopened, range(3)) == [True] * 3
    reopened.close()


def test_blocks_are_served_to_a_fresh_process(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, range(3))
    tier.close()
    out = run_python(CHILD_PRELUDE + f"""
tier = DiskTier(L, {store_path!r}, 4 << 20)
dests = [torch.empty(L.block_nbytes, dtype=torch.uint8) for _ in range(3)]
ok = tier.get([key(i) for i in range(3)], [tokens(i) for i in range(3)], dests)
print(ok, all(torch.equal(d, payload(i)) for i, d in enumerate(dests)))
tier.close()
""")
    assert out.strip() == "[True, True, True] True"


def test_pending_puts_are_served_before_the_writer_commits_them(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    gate = stall_the_writer(tier)  # the puts stay pending
    put_blocks(tier, range(3))
    assert tier.stats().extra["pending_puts"] == 3
    assert tier.count_prefix([key(0), key(1), key(2), key(3)]) == 3
    assert tier.held([key(3), key(1)]) == [False, True]
    assert get_blocks(tier, range(3)) == [True] * 3
    chains = [[key(0), key(1), key(2), key(3)], [key(1), key(3), key(2)], [], [key(3)]]
    assert tier.count_prefixes(chains) == [3, 1, 0, 0]  # many chains, one snapshot
    gate.set()
    tier.flush()
    assert tier.stats().extra["pending_puts"] == 0
    assert tier.held([key(3), key(1), key(0)]) == [False, True, True]  # committed: from the store
    assert tier.count_prefixes(chains) == [3, 1, 0, 0]
    assert get_blocks(tier, range(3)) == [True] * 3
    tier.close()


def test_pending_puts_are_written_when_the_interpreter_exits(store_path):
    run_python(CHILD_PRELUDE + f"""
tier = DiskTier(L, {store_path!r}, 4 << 20)
tier.put([key(i) for i in range(20)], [tokens(i) for i in range(20)], [payload(i) for i in range(20)])
# no close(): the tier closes itself at exit
""")
    assert read_store_stats(store_path)["entries"] == 20


def test_full_store_evicts_the_least_recently_read_block_and_stays_within_capacity(store_path):
    capacity = 4 * RecordCodec(BF16).record_nbytes
    tier = DiskTier(BF16, store_path, capacity)
    put_blocks(tier, [1, 2, 3, 4])
    tier.flush()
    assert get_blocks(tier, [1]) == [True]  # 1 becomes most recent: 2 is now the oldest
    put_blocks(tier, [5])
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 2, 3, 4, 5)] == [True, False, True, True, True]
    put_blocks(tier, range(10, 30))
    tier.flush()
    stats = tier.stats()
    assert stats.used_bytes <= capacity
    assert stats.evictions == 1 + 20
    assert get_blocks(tier, range(26, 30)) == [True] * 4
    tier.close()


def test_reads_commit_no_write_until_a_write_or_flush_applies_their_touches(store_path):
    """A promotion's reads must not pay for write transactions (a commit, an fsync) beside them; the LRU order
    they set is applied before the next write, which is the only thing that evicts."""
    capacity = 4 * RecordCodec(BF16).record_nbytes
    tier = DiskTier(BF16, store_path, capacity)
    put_blocks(tier, [1, 2, 3, 4])
    tier.flush()
    time.sleep(0.1)  # the writer is back waiting for work (not still looking at its queue after the flush)
    last_write = tier._store.env.info()["last_txnid"]
    for _ in range(5):
        assert get_blocks(tier, [1, 2]) == [True, True]
    time.sleep(0.2)  # a woken writer would have committed by now
    assert tier._store.env.info()["last_txnid"] == last_write
    put_blocks(tier, [5])  # 3 is now the least recently read: the touches went in before this eviction
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 2, 3, 4, 5)] == [True, True, False, True, True]
    tier.close()


def test_a_put_of_a_held_block_keeps_it_from_the_evictions_queued_before_it(store_path):
    """An upper tier letting block 1 go puts it here; the store holds it, so only its touch is queued. The puts
    queued before that touch must not evict it on the way: then no tier would hold it."""
    tier = DiskTier(BF16, store_path, 2 * RecordCodec(BF16).record_nbytes)
    put_blocks(tier, [1, 2])  # 1 is the oldest
    tier.flush()
    go = stall_the_writer(tier)
    put_blocks(tier, [3])  # queued: it needs room, and 1 is the oldest
    put_blocks(tier, [1])  # held: a touch queued behind the put of 3
    go.set()
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 2, 3)] == [True, False, True]
    assert get_blocks(tier, [1]) == [True]
    put_blocks(tier, [4])  # once its touch is applied, 1 is evicted in its turn again
    put_blocks(tier, [5])
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 3, 4, 5)] == [False, False, True, True]
    tier.close()


def test_a_put_of_a_block_the_transaction_in_flight_evicted_stores_it_again(store_path):
    """The last committed snapshot still holds block 1 while the writer's open transaction has evicted it: a put
    of 1 then must store its record, not queue a touch of a block about to be gone."""
    tier = DiskTier(BF16, store_path, 2 * RecordCodec(BF16).record_nbytes)
    put_blocks(tier, [1, 2])
    tier.flush()
    evicted, go = threading.Event(), threading.Event()
    store = tier._store
    insert = store.insert

    def insert_then_stall(*args, **kwargs):
        stored = insert(*args, **kwargs)  # 1 evicted for 3, not committed yet
        evicted.set()
        go.wait()
        return stored

    store.insert = insert_then_stall
    put_blocks(tier, [3])
    assert evicted.wait(10)
    assert tier.contains(key(1))  # the snapshot does not know yet
    put_blocks(tier, [1])
    store.insert = insert
    go.set()
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 2, 3)] == [True, False, True]
    assert get_blocks(tier, [1, 3]) == [True, True]
    tier.close()


def test_lru_order_is_kept_in_the_store_across_reopen(store_path):
    capacity = 3 * RecordCodec(BF16).record_nbytes
    tier = DiskTier(BF16, store_path, capacity)
    put_blocks(tier, [1, 2, 3])
    tier.flush()
    get_blocks(tier, [1])
    tier.close()
    tier = DiskTier(BF16, store_path, capacity)
    put_blocks(tier, [4])
    tier.flush()
    assert [tier.contains(key(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
    tier.close()


def test_many_writes_far_beyond_capacity_never_fail(store_path):
    layout = BlockLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    capacity = 10 * RecordCodec(layout).record_nbytes
    tier = DiskTier(layout, store_path, capacity, writer_batch=8)
    for start in range(0, 300, 25):
        put_blocks(tier, range(start, start + 25), layout)
    tier.flush()
    stats = tier.stats()
    assert stats.used_bytes <= capacity and stats.extra["write_errors"] == 0
    assert get_blocks(tier, range(290, 300), layout) == [True] * 10
    tier.close()


def test_one_put_larger_than_the_write_queue_completes(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, writer_batch=2)  # at most 8 puts wait in memory
    put_blocks(tier, range(50))
    tier.flush()
    assert get_blocks(tier, range(50)) == [True] * 50
    tier.close()


def test_token_mismatch_is_a_counted_miss_and_drops_the_entry(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.flush()
    wrong = tokens(1)
    wrong[0] += 1
    assert get_blocks(tier, [1], toks=[wrong]) == [False]
    tier.flush()
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.corrupt, stats.misses, stats.hits, stats.used_blocks, stats.used_bytes) == (1, 1, 0, 0, 0)
    tier.close()


@pytest.mark.parametrize("mangle", [
    pytest.param(lambda v: v[:-1] + bytes([v[-1] ^ 0x01]), id="flipped-payload-bit"),
    pytest.param(lambda v: v[: len(v) // 2], id="truncated"),
    pytest.param(lambda v: v[:4], id="header-only"),
    pytest.param(lambda v: b"\xff" * len(v), id="garbage-header"),
    pytest.param(lambda v: b"", id="empty"),
])
def test_a_damaged_value_is_a_counted_miss_never_served(store_path, mangle):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1, 2])
    tier.close()
    corrupt_value(store_path, 1, mangle)
    tier = DiskTier(BF16, store_path, 4 * MiB)
    assert get_blocks(tier, [1, 2]) == [False, True]
    tier.flush()
    assert not tier.contains(key(1)) and tier.contains(key(2))
    assert tier.stats().corrupt == 1
    tier.close()


def test_a_block_from_another_layout_is_a_miss(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.close()
    other = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    assert other.block_nbytes == BF16.block_nbytes  # same size, different meaning
    tier = DiskTier(other, store_path, 4 * MiB)
    dest = torch.empty(other.block_nbytes, dtype=torch.uint8)
    assert tier.get([key(1)], [tokens(1)], [dest]) == [False]
    assert tier.stats().corrupt == 1
    tier.close()


def test_put_of_a_held_block_keeps_the_stored_bytes(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.flush()
    tier.put([key(1)], [tokens(1)], [payload(BF16, 99)])
    tier.flush()
    assert get_blocks(tier, [1]) == [True]
    assert tier.stats().puts == 1
    tier.close()


def test_discard_and_clear_remove_blocks(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, range(4))
    assert tier.discard(key(0)) and not tier.discard(key(0))
    assert tier.stats().used_blocks == 3
    tier.clear()
    stats = tier.stats()
    assert (stats.used_blocks, stats.used_bytes) == (0, 0)
    assert get_blocks(tier, range(4)) == [False] * 4
    tier.close()


def test_discard_many_drops_the_held_blocks_in_one_commit_seen_by_a_fresh_process(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, range(6))
    tier.flush()
    commits = []
    commit = tier._commit
    tier._commit = lambda batch: (commits.append(len(batch)), commit(batch))
    assert tier.discard_many([key(i) for i in (0, 2, 4, 99)]) == 3  # 99 was never put
    assert len(commits) == 1
    assert tier.stats().used_blocks == 3
    assert blocks_a_fresh_process_reads(store_path) == 3  # committed before it returned
    assert get_blocks(tier, range(6)) == [False, True, False, True, False, True]
    tier.close()


def blocks_a_fresh_process_reads(path: str) -> int:
    """The blocks another process finds committed in the store at `path` (LMDB read directly: no kvstrata import)."""
    code = ("import lmdb, sys; env = lmdb.open(sys.argv[1], max_dbs=4, readonly=True, lock=False); "
            "blocks = env.open_db(b'blocks', create=False); print(env.begin().stat(blocks)['entries'])")
    run = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout)


def test_close_is_idempotent_and_later_use_is_an_error(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.contains(key(1))


def test_unwritable_path_is_a_one_line_error_naming_the_key(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"^cache\.tiers\.disk\.path: cannot write to '.*a-file/store'"):
        DiskTier(BF16, str(blocker / "store"), 4 * MiB)


def test_capacity_beyond_free_space_is_an_error_naming_the_key(store_path):
    with pytest.raises(ValueError, match=r"^cache\.tiers\.disk\.size: .* is more than the free space at"):
        DiskTier(BF16, store_path, 1 << 62)


def test_capacity_below_one_block_is_an_error_naming_the_key(store_path):
    with pytest.raises(ValueError, match=r"^cache\.tiers\.disk\.size: .* smaller than one block"):
        DiskTier(BF16, store_path, BF16.block_nbytes // 2)


def test_two_processes_share_one_store(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.flush()
    out = run_python(CHILD_PRELUDE + f"""
tier = DiskTier(L, {store_path!r}, 4 << 20)
print(tier.contains(key(1)))
tier.put([key(i) for i in (2, 3)], [tokens(i) for i in (2, 3)], [payload(i) for i in (2, 3)])
tier.flush()
tier.close()
""")
    assert out.strip() == "True"  # the child saw ours, while we hold the store open
    assert get_blocks(tier, [1, 2, 3]) == [True] * 3  # and we see the child's
    tier.close()


def test_admin_helpers_report_and_clear_a_store_without_its_layout(store_path, tmp_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, range(6))
    tier.close()
    stats = read_store_stats(store_path)
    assert stats["entries"] == 6
    assert 6 * BF16.block_nbytes < stats["used_bytes"] <= 6 * RecordCodec(BF16).record_nbytes
    assert stats["capacity_bytes"] == 4 * MiB
    assert stats["file_bytes"] >= stats["used_bytes"]
    assert clear_store(store_path).blocks == 6
    assert read_store_stats(store_path)["entries"] == 0
    with pytest.raises(ValueError, match="not a kvstrata disk store"):
        read_store_stats(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="not a kvstrata disk store"):
        clear_store(str(tmp_path))


# ---------------------------------------------------------------------------------- file modes


def modes(path: str) -> tuple[int, int, int]:
    return tuple(stat.S_IMODE(os.stat(p).st_mode) for p in (path, f"{path}/data.mdb", f"{path}/lock.mdb"))


def test_a_new_store_is_private_to_its_owner_whatever_the_umask(tmp_path):
    path = str(tmp_path / "parent" / "kvstore")
    previous = os.umask(0)
    try:
        tier = DiskTier(BF16, path, 4 * MiB)
        put_blocks(tier, [1])
        tier.close()
    finally:
        os.umask(previous)
    assert modes(path) == (0o700, 0o600, 0o600)


def test_an_existing_store_with_looser_modes_is_tightened_when_its_owner_opens_it(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.close()
    os.chmod(store_path, 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(f"{store_path}/{name}", 0o644)
    tier = DiskTier(BF16, store_path, 4 * MiB)
    assert modes(store_path) == (0o700, 0o600, 0o600)
    assert get_blocks(tier, [1]) == [True]
    tier.close()


# ---------------------------------------------------------------------------------- a full or grown map

# Blocks of 256 KiB: a few hundred of them outgrow LMDB's map, which always has 64 MiB of headroom.
BIG = BlockLayout(num_layers=8, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)


def test_a_full_map_drops_writes_counted_and_later_writes_succeed_once_room_is_made(store_path):
    capacity = 8 * RecordCodec(BIG).record_nbytes
    tier = DiskTier(BIG, store_path, capacity, writer_batch=4)
    put_blocks(tier, range(8), BIG)
    tier.flush()
    # Another process holds a read snapshot: LMDB cannot reuse a page freed after it, so replacing
    # blocks over and over grows the file until the map is full.
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, lmdb
        env = lmdb.open({store_path!r}, max_dbs=4, map_size=0, readonly=True)
        txn = env.begin()
        print("holding", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "holding"
    for start in range(100, 500, 20):
        put_blocks(tier, range(start, start + 20), BIG)
    tier.flush()
    failed = tier.stats().extra["write_errors"]
    assert failed > 0  # the map filled: writes were dropped and counted, nothing raised
    reader.communicate("")  # the snapshot is released: its pages can be reused
    put_blocks(tier, range(1000, 1008), BIG)
    tier.flush()
    assert tier.stats().extra["write_errors"] == failed
    assert get_blocks(tier, range(1000, 1008), BIG) == [True] * 8
    assert tier.stats().used_bytes <= capacity
    tier.close()


def grow_in_another_process(store_path: str) -> None:
    """Another process puts 320 blocks of `BIG` (80 MiB) in the store at `store_path`, opened 128 MiB large: they
    outgrow the map of a process that opened it smaller (LMDB: MDB_MAP_RESIZED). Blocks 0-319."""
    run_python(CHILD_PRELUDE + f"""
from kvstrata.tiers.base import BlockLayout
L = BlockLayout(num_layers=8, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)
def payload(i): return tier_cases.payload(L, i)
tier = DiskTier(L, {store_path!r}, 128 << 20)
for start in range(0, 320, 32):
    ids = range(start, start + 32)
    tier.put([key(i) for i in ids], [tokens(i, L) for i in ids], [payload(i) for i in ids])
tier.close()
""")


def test_a_store_grown_by_a_process_with_a_larger_size_is_still_read_and_written(store_path):
    small = DiskTier(BIG, store_path, 2 * RecordCodec(BIG).record_nbytes, writer_batch=1)
    grow_in_another_process(store_path)
    assert get_blocks(small, [318, 319], BIG) == [True, True]
    put_blocks(small, [1000], BIG)
    small.flush()
    assert get_blocks(small, [1000], BIG) == [True]
    assert small.stats().extra["write_errors"] == 0
    small.close()


def test_a_second_tier_on_a_store_open_in_this_process_is_refused_and_leaves_it_alone(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1])
    tier.flush()
    with pytest.raises(ValueError, match=r"^cache\.tiers\.disk\.path: cannot open the store .* already open"):
        DiskTier(BF16, store_path, 4 * MiB)
    assert get_blocks(tier, [1]) == [True] and not glob.glob(f"{store_path}/*.corrupt-*")
    tier.close()


def test_a_commit_between_reading_the_file_size_and_the_pages_in_use_is_not_damage(tmp_path):
    """Before each transaction a reader checks that the data file holds every page LMDB uses (a truncated
    file would end the process). A writer committing at that moment (a write-down while blocks are read)
    grows the file and then the page count; a size read before the count must not make the store look
    truncated, or a healthy store would be moved aside and its blocks lost."""
    from kvstrata.tiers.lmdb_store import LmdbStore, StoreDamaged, data_file

    store = LmdbStore.open(str(tmp_path / "kv"), 64 << 20, 32 << 20)
    data, psize, env = data_file(store.path), store._psize, store.env

    class CommitsWhileCounted:
        """The store's environment, but a commit lands while its page count is read."""

        def info(self):
            os.truncate(data, os.path.getsize(data) + 4 * psize)  # the commit's new pages, then its meta page
            return {**env.info(), "last_pgno": os.path.getsize(data) // psize - 1}

    store.env = CommitsWhileCounted()
    store.check_size()  # not damaged
    store.env = env
    os.truncate(data, 3 * psize)  # and a file that really lacks pages in use is
    with pytest.raises(StoreDamaged, match="data.mdb is truncated"):
        store.check_size()
    store.close()


def test_blocks_written_down_while_others_are_read_all_stay_served(tmp_path, caplog):
    """Write-downs and reads at once, as an engine does (the writer thread commits while loads read):
    no read may take a busy store for a damaged one, and every block written stays served."""
    disk = DiskTier(BF16, str(tmp_path / "kv"), 64 << 20, check_integrity=False)
    put_blocks(disk, range(8))
    disk.flush()
    stop = threading.Event()
    misses = []

    def read_the_first_blocks():
        while not stop.is_set():
            served = get_blocks(disk, range(8))
            if not all(served):
                misses.append(served)

    readers = [threading.Thread(target=read_the_first_blocks) for _ in range(2)]
    for reader in readers:
        reader.start()
    for start in range(8, 4008, 20):
        put_blocks(disk, range(start, start + 20))
        disk.flush()
    stop.set()
    for reader in readers:
        reader.join()
    assert misses == [] and "damaged" not in caplog.text
    assert all(get_blocks(disk, range(4008)))
    assert disk.stats().corrupt == 0
    disk.close()


def test_two_processes_finding_their_shared_store_damaged_replace_it_once(tmp_path):
    """Engines sharing a disk store (one directory, several processes) that all find it damaged at start
    take turns moving it aside: the first starts a fresh store, the others check that one and open it,
    rather than moving it aside too (losing what the first writes there) or failing to start."""
    path = tmp_path / "kv"
    disk = DiskTier(BF16, str(path), 8 * MiB)
    put_blocks(disk, range(4))
    disk.close()
    os.truncate(path / "data.mdb", 3 * 4096)  # damaged: LMDB uses more pages than that
    go = tmp_path / "go"
    children = []
    for first_block in (10, 20):  # each writes blocks of its own once open
        ready = tmp_path / f"ready-{first_block}"
        code = CHILD_PRELUDE + textwrap.dedent(f"""
            import os, time
            open({str(ready)!r}, "w").close()
            while not os.path.exists({str(go)!r}):  # both start opening at once
                time.sleep(0.001)
            tier = DiskTier(L, {str(path)!r}, {8 * MiB})
            ids = range({first_block}, {first_block + 4})
            tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(i) for i in ids])
            tier.close()
            """)
        children.append((ready, subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)))
    for ready, child in children:
        while not ready.exists():
            assert child.poll() is None, child.stderr.read()
    go.touch()
    for _, child in children:
        assert child.wait(timeout=120) == 0, child.stderr.read()
    assert len(glob.glob(str(path / "data.mdb.corrupt-*"))) == 1
    reopened = DiskTier(BF16, str(path), 8 * MiB)
    assert all(get_blocks(reopened, [*range(10, 14), *range(20, 24)]))  # one fresh store, nothing lost
    reopened.close()


def test_a_running_engine_follows_a_store_another_process_replaced(tmp_path, caplog):
    """A process sharing the store found it damaged, moved it aside and started a fresh one: this
    process's next write-down goes to the fresh store (not to the moved file nobody opens again), and it
    reads what the other process writes there."""
    path = tmp_path / "kv"
    disk = DiskTier(BF16, str(path), 8 * MiB)
    put_blocks(disk, range(4))
    disk.flush()
    run_python(CHILD_PRELUDE + f"""
from kvstrata.tiers.lmdb_store import quarantine
quarantine({str(path)!r}, "found damaged by another process")
fresh = DiskTier(L, {str(path)!r}, {8 * MiB})
fresh.put([key(20)], [tokens(20)], [payload(20)])
fresh.close()
""")
    put_blocks(disk, [10])
    disk.flush()
    assert "another process replaced the damaged store" in caplog.text
    assert get_blocks(disk, [10, 20]) == [True, True]
    disk.close()
    reopened = DiskTier(BF16, str(path), 8 * MiB)
    assert get_blocks(reopened, [0, 10, 20]) == [False, True, True]  # the moved store's blocks are gone
    reopened.close()
