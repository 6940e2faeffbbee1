"""The disk tier's reader processes: blocks read into shared host memory are read by another process, verified
there, and come out byte-exact; anything that does not verify is a counted miss; a store grown or replaced by
another process is followed; a reader that dies costs no block (its read is done in this process) and closing
the tier ends them all."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from test_disk_tier import BIG, CHILD_PRELUDE, corrupt_value, grow_in_another_process, run_python
from tier_cases import (BF16, FP32, by_processes, key, kill_a_reader_and_read_on, payload, put_blocks, read_shared,
                        tokens)

from kvstrata.tiers import reader_pool
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.shared_memory import Place, is_live, locate, segment_fd, shared_empty

MiB = 1 << 20


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "kvstore")


@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_blocks_read_by_reader_processes_are_the_stored_bytes(store_path, layout):
    tier = DiskTier(layout, store_path, 4 * MiB, read_processes=2)
    put_blocks(tier, range(12), layout)
    tier.flush()  # committed: served from the store, not from the writer's queue
    assert read_shared(tier, [*range(12), 99], layout) == [True] * 12 + [False]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.extra["blocks_read_by_processes"]) == (12, 1, 12)
    assert stats.extra["read_processes"] == 2
    tier.close()


def test_reads_into_private_memory_or_of_queued_puts_are_served_in_this_process(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    put_blocks(tier, [1, 2])
    tier.flush()
    dest = torch.empty(BF16.block_nbytes, dtype=torch.uint8)
    assert tier.get([key(1)], [tokens(1)], [dest]) == [True] and torch.equal(dest, payload(BF16, 1))
    assert by_processes(tier) == 0
    gate = threading.Event()
    commit = tier._commit
    tier._commit = lambda batch: (gate.wait(), commit(batch))  # hold the writer: the put stays queued
    put_blocks(tier, [3])
    assert read_shared(tier, [2, 3]) == [True, True]
    assert by_processes(tier) == 1  # block 2; block 3 from the writer's queue, here
    gate.set()
    tier.close()


def test_a_token_mismatch_read_by_a_reader_is_a_counted_miss_and_drops_the_entry(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    put_blocks(tier, [1, 2])
    tier.flush()
    wrong = tokens(1)
    wrong[0] += 1
    assert read_shared(tier, [1, 2], toks=[wrong, tokens(2)]) == [False, True]
    tier.flush()
    assert not tier.contains(key(1)) and tier.contains(key(2))
    assert (tier.stats().corrupt, by_processes(tier)) == (1, 1)
    tier.close()


@pytest.mark.parametrize("mangle", [
    pytest.param(lambda v: v[:-1] + bytes([v[-1] ^ 0x01]), id="flipped-payload-bit"),
    pytest.param(lambda v: v[: len(v) // 2], id="truncated"),
    pytest.param(lambda v: b"\xff" * len(v), id="garbage-header"),
])
def test_a_damaged_value_read_by_a_reader_is_a_counted_miss_never_served(store_path, mangle):
    tier = DiskTier(BF16, store_path, 4 * MiB)
    put_blocks(tier, [1, 2])
    tier.close()
    corrupt_value(store_path, 1, mangle)
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    assert read_shared(tier, [1, 2]) == [False, True]
    assert (tier.stats().corrupt, by_processes(tier)) == (1, 1)
    tier.close()


def test_a_store_grown_by_another_process_is_read_by_the_readers(store_path):
    tier = DiskTier(BIG, store_path, 4 * MiB, writer_batch=1, read_processes=1)
    put_blocks(tier, [0], BIG)
    tier.flush()
    assert read_shared(tier, [0], BIG) == [True]  # the reader has the store open, at its first size
    grow_in_another_process(store_path)
    assert read_shared(tier, [318, 319], BIG) == [True, True]
    assert by_processes(tier) == 3
    tier.close()


def test_the_readers_follow_a_store_another_process_replaced(tmp_path, caplog):
    path = str(tmp_path / "kv")
    tier = DiskTier(BF16, path, 8 * MiB, read_processes=1)
    put_blocks(tier, range(4))
    tier.flush()
    assert read_shared(tier, [0]) == [True]
    run_python(CHILD_PRELUDE + f"""
from kvstrata.tiers.lmdb_store import quarantine
quarantine({path!r}, "found damaged by another process")
fresh = DiskTier(L, {path!r}, {8 * MiB})
fresh.put([key(20)], [tokens(20)], [payload(20)])
fresh.close()
""")
    put_blocks(tier, [10])  # the writer finds the store replaced and follows it
    tier.flush()
    assert read_shared(tier, [1, 10, 20]) == [False, True, True]
    assert by_processes(tier) == 3
    tier.close()


def test_a_killed_reader_costs_no_block_and_is_replaced(store_path, caplog):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    put_blocks(tier, range(4))
    tier.flush()
    kill_a_reader_and_read_on(tier, caplog)
    tier.close()


def killed_while_reading(store_path: str) -> int:
    """The pid of a process killed inside a read transaction on the store at `store_path`: its reader slot, with
    the snapshot it read, stays registered in the store's lock file."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        import lmdb
        env = lmdb.open({store_path!r}, readonly=True, max_dbs=8)
        txn = env.begin()
        print("reading", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "reading"
    child.kill()
    child.wait()
    return child.pid


def registered_readers(tier: DiskTier) -> set[int]:
    return {int(line.split()[0]) for line in tier._store.env.readers().splitlines()[1:] if line.strip()}


def test_a_process_killed_while_reading_is_cleared_from_the_store_when_the_tier_opens(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=0)
    put_blocks(tier, range(4))
    tier.close()
    # another process keeps the store open throughout (an engine sharing it): LMDB then keeps its reader table as
    # it is when the tier opens, the dead reader's slot included
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        import lmdb
        env = lmdb.open({store_path!r}, readonly=True, max_dbs=8)
        print("open", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        dead = killed_while_reading(store_path)
        tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=0)
        assert dead not in registered_readers(tier)  # else the writer never reuses a page freed after its snapshot
        assert read_shared(tier, [0, 1, 2, 3]) == [True] * 4
        tier.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_process_killed_while_reading_is_cleared_from_the_store_when_a_reader_process_is_replaced(store_path,
                                                                                                     caplog):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    put_blocks(tier, range(4))
    tier.flush()
    dead = killed_while_reading(store_path)  # as a reader process killed in the middle of a read leaves it
    assert dead in registered_readers(tier)
    kill_a_reader_and_read_on(tier, caplog)
    assert dead not in registered_readers(tier)
    tier.close()


def test_readers_that_keep_dying_are_given_up_and_every_read_is_still_served(store_path, monkeypatch, caplog):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    put_blocks(tier, range(2))
    tier.flush()
    for _ in range(reader_pool.MAX_RESTARTS + 1):
        (pid,) = tier._readers.pids
        os.kill(pid, signal.SIGKILL)
        assert read_shared(tier, [0, 1]) == [True, True]
    assert "every read from now on" in caplog.text
    assert tier.stats().extra["read_processes"] == 0
    assert read_shared(tier, [0, 1]) == [True, True]
    assert by_processes(tier) == 0
    tier.close()


def test_closing_the_tier_ends_its_reader_processes(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=2)
    put_blocks(tier, [1])
    tier.flush()
    assert read_shared(tier, [1]) == [True]
    pids = tier._readers.pids
    tier.close()
    assert len(pids) == 2
    for pid in pids:  # ended and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_shared_memory_is_located_while_a_view_lives_and_freed_after():
    kv = shared_empty((4, 3, 8), torch.float16)
    assert torch.count_nonzero(kv) == 0
    assert locate(kv[2]) == Place(locate(kv).segment, 2 * 3 * 8 * 2)
    assert locate(kv[:, 1]) is None  # not contiguous: a reader could not write it as one run
    assert locate(torch.zeros(4)) is None and locate(kv[1].clone()) is None
    view, segment = kv[3], locate(kv).segment
    fd = segment_fd(segment)
    del kv
    assert is_live(segment) and locate(view) is not None
    del view
    assert not is_live(segment) and segment_fd(segment) is None
    with pytest.raises(OSError):
        os.fstat(fd)  # its descriptor is closed with it


def test_memory_shared_ahead_of_the_reads_is_read_into(store_path):
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=2)
    put_blocks(tier, range(3))
    tier.flush()
    kv = shared_empty((8, BF16.block_nbytes), torch.uint8)
    assert not any(_maps(pid, "memfd:kvstrata-kv") or _maps(pid, "data.mdb") for pid in tier._readers.pids)
    tier.share(kv)  # returns once every reader has mapped it and opened the store: no read (nor the load policy's
    # start-up probe) waits for that
    assert all(_maps(pid, "memfd:kvstrata-kv") and _maps(pid, "data.mdb") for pid in tier._readers.pids)
    staging = shared_empty((2, BF16.block_nbytes), torch.uint8)
    tier.share(kv, staging)  # several at once: only what a reader lacks is sent
    assert all(_maps(pid, "memfd:kvstrata-kv", 2) for pid in tier._readers.pids)
    tier.share(torch.zeros(4))  # private memory: nothing to share
    assert tier.get([key(i) for i in range(3)], [tokens(i) for i in range(3)], [kv[5], kv[1], kv[7]]) == [True] * 3
    assert [torch.equal(kv[b], payload(BF16, i)) for i, b in enumerate((5, 1, 7))] == [True] * 3
    assert by_processes(tier) == 3
    tier.close()


def test_readers_that_cannot_start_leave_the_reads_in_this_process(store_path, monkeypatch, caplog):
    def no_process(*args, **kwargs):
        raise OSError("Cannot allocate memory")

    monkeypatch.setattr(reader_pool.subprocess, "Popen", no_process)
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=2)
    assert "cannot start its reader processes (Cannot allocate memory)" in caplog.text
    put_blocks(tier, [1])
    tier.flush()
    assert read_shared(tier, [1]) == [True]
    assert (tier.stats().extra["read_processes"], by_processes(tier)) == (0, 0)
    tier.close()


def test_readers_exit_when_the_engines_process_is_killed(store_path):
    """kill -9 of the process that started them leaves no reader behind: each sees its socket close."""
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD_PRELUDE + f"""
tier = DiskTier(L, {store_path!r}, 4 << 20, read_processes=2)
print(*tier._readers.pids, flush=True)
import time
time.sleep(60)
""")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
    finally:
        engine.kill()
        engine.wait()
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, nor a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def tiny_engine_config(store: str, **disk) -> dict:
    return {"model": {"name": "tiny-llama", "load_format": "dummy", "dtype": "float32", "device": "cpu"},
            # always_load: with a model this small, recomputing a document may cost less than reading it
            "cache": {"load_policy": "always_load",
                      "tiers": {"device": {"size": 64}, "disk": {"path": store, "size": "64MiB", **disk}}}}


def disk_hit(llm, prompt: list[int]) -> tuple[list[int], int]:
    """The prompt's greedy answer once its blocks are on disk only, and the disk-tier tokens it was served."""
    from kvstrata import SamplingParams
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(prompt, greedy)[0]
    llm.engine.hierarchy.wait_for_write_downs()
    llm.engine.hierarchy.disk.flush()  # committed: read from the store (the writer's queue is read in-process)
    assert llm.engine.hierarchy.clear_device_cache()
    again = llm.generate(prompt, greedy)[0]
    assert again.token_ids == first.token_ids
    return again.token_ids, again.cached_tokens_by_tier["disk"]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["readers", "no-shared-memory"])
def test_an_engines_disk_hits_are_read_by_its_readers_or_in_process_without_shared_memory(
        tmp_path, monkeypatch, caplog, shared_memory):
    from kvstrata import LLM, load_config
    if not shared_memory:
        def refused(*args):
            raise OSError("Function not implemented")
        monkeypatch.setattr(os, "memfd_create", refused)
    with LLM(load_config(tiny_engine_config(str(tmp_path / "kv")))) as llm:
        _, disk_tokens = disk_hit(llm, [100 + i for i in range(200)])
        extra = llm.stats()["tiers"]["disk"]["extra"]
    assert disk_tokens >= 192
    if shared_memory:
        assert extra["blocks_read_by_processes"] >= 12 and extra["read_processes"] >= 1
    else:
        assert "cannot put the KV cache in shared memory (Function not implemented)" in caplog.text
        assert extra["blocks_read_by_processes"] == 0


def test_read_processes_zero_reads_in_the_engines_process(tmp_path):
    from kvstrata import LLM, load_config
    with LLM(load_config(tiny_engine_config(str(tmp_path / "kv"), read_processes=0))) as llm:
        _, disk_tokens = disk_hit(llm, [100 + i for i in range(200)])
        extra = llm.stats()["tiers"]["disk"]["extra"]
    assert disk_tokens >= 192 and (extra["read_processes"], extra["blocks_read_by_processes"]) == (0, 0)


def test_a_stuck_reader_is_killed_after_the_timeout_and_its_read_done_in_process(store_path, monkeypatch, caplog):
    monkeypatch.setattr(reader_pool, "READ_TIMEOUT_S", 0.5)
    tier = DiskTier(BF16, store_path, 4 * MiB, read_processes=1)
    # its replacement gets the usual timeout: a process started on a busy machine may take longer than 0.5 s
    monkeypatch.setattr(reader_pool, "READ_TIMEOUT_S", 30.0)
    put_blocks(tier, range(3))
    tier.flush()
    (pid,) = tier._readers.pids
    os.kill(pid, signal.SIGSTOP)  # alive, never answering
    started = time.monotonic()
    assert read_shared(tier, [0, 1, 2]) == [True] * 3
    assert time.monotonic() - started < 10
    assert "a reader process did not answer in 0.5 s and was killed" in caplog.text
    assert not _running(pid) and tier._readers.pids != [pid]
    assert read_shared(tier, [0]) == [True] and by_processes(tier) == 1  # by its replacement
    tier.close()


def _maps(pid: int, name: str, count: int = 1) -> bool:
    """Whether process `pid` maps `count` files whose names contain `name`."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if name in line}) == count  # distinct inodes
