"""The transfer engine on a CPU: the same asynchronous interface as on CUDA, run on worker threads.

Loads and stores complete in the background and in submission order per direction, a failure is
reported as unserved blocks (never raised on the caller's thread), and `wait_copied` is what makes
a block safe to reuse. On a GPU (`pytest -m cuda`, skipped without one) the same jobs go through
pinned staging and a side stream per direction.
"""
import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from kvstrata.tiers.base import BlockLayout, as_bytes
from kvstrata.tiers import transfer as transfer_module
from kvstrata.tiers.transfer import LentBlocks, TransferEngine, contiguous_runs, copy_each, copy_rows

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def engine(num_blocks: int = 8) -> TransferEngine:
    return TransferEngine(LAYOUT.allocate(num_blocks))


def fill_with(values: dict[int, int], gate: threading.Event | None = None):
    """A fill that writes byte value `values[start + i]` into view i (after `gate`, if given)."""
    def fill(start, views):
        if gate is not None:
            assert gate.wait(10)
        for i, view in enumerate(views):
            view.fill_(values[start + i])
        return [True] * len(views)
    return fill


def test_load_lands_in_the_background_and_writes_only_its_blocks():
    transfers = engine()
    gate = threading.Event()
    job = transfers.load([2, 5], fill_with({0: 7, 1: 9}, gate))
    assert not job.done  # the caller's thread is not blocked by the copy
    gate.set()
    assert job.wait(10) and job.served == [True, True]
    kv = transfers.kv_cache
    assert bool((as_bytes(kv[2]) == 7).all()) and bool((as_bytes(kv[5]) == 9).all())
    assert all(bool((as_bytes(kv[b]) == 0).all()) for b in (0, 1, 3, 4, 6, 7))
    transfers.close()


def test_jobs_of_one_direction_complete_in_submission_order():
    transfers = engine()
    gate = threading.Event()
    first = transfers.load([0], fill_with({0: 1}, gate))
    second = transfers.load([0], fill_with({0: 2}))
    assert not second.wait(0.2)  # queued behind the first
    gate.set()
    assert second.wait(10) and first.done
    assert bool((as_bytes(transfers.kv_cache[0]) == 2).all())
    transfers.close()


def test_runs_of_neighbouring_blocks_and_rows_move_as_one_copy():
    assert contiguous_runs([4, 5, 6, 9, 10, 11, 2], [7, 8, 9, 10, 12, 13, 14]) == [
        (4, 7, 3), (9, 10, 1), (10, 12, 2), (2, 14, 1)]
    assert contiguous_runs([], []) == []


def lend_rows(slab: torch.Tensor, rows: list[int], released: list[int]):
    """A lend of `rows` of `slab` for any chunk: the chunk's own rows; `released` counts releases."""
    def lend(start, n):
        return LentBlocks(slab, rows[start:start + n], lambda: released.append(1))
    return lend


def test_lent_blocks_are_copied_straight_from_the_slab_and_released_once_landed():
    transfers = engine()
    slab = torch.randint(0, 256, (6, LAYOUT.block_nbytes), dtype=torch.uint8)
    released = []

    def fill(start, views):
        raise AssertionError("lent blocks are not read through fill")

    job = transfers.load([3, 4, 0], fill, lend_rows(slab, [1, 2, 5], released))
    assert job.wait(10) and job.served == [True, True, True] and released == [1]
    for block, row in ((3, 1), (4, 2), (0, 5)):
        assert torch.equal(as_bytes(transfers.kv_cache[block]), slab[row])
    transfers.close()


@pytest.fixture
def foreach_calls(monkeypatch):
    """How many times torch's one-call copy of a list ran (each call gives up the interpreter lock once)."""
    calls = []
    real = torch._foreach_copy_

    def counted(dests, srcs, **kwargs):
        calls.append(len(dests))
        real(dests, srcs, **kwargs)

    monkeypatch.setattr(transfer_module.torch, "_foreach_copy_", counted)
    return calls


@pytest.mark.parametrize("num_copies", [1, transfer_module.FEW_COPIES, transfer_module.FEW_COPIES + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_each_copies_every_pair(num_copies, threads, foreach_calls):
    dests = [torch.zeros(1000 + k, dtype=torch.uint8) for k in range(num_copies)]
    srcs = [torch.randint(0, 256, (1000 + k,), dtype=torch.uint8) for k in range(num_copies)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        copy_each(dests, srcs)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs))
    # many host copies go in one call, unless torch would split each over several threads; a few go one by one
    assert foreach_calls == ([num_copies] if num_copies > transfer_module.FEW_COPIES and threads == 1 else [])


def test_copy_rows_moves_each_row_and_many_runs_in_one_call(foreach_calls):
    src = torch.randint(0, 256, (12, 64), dtype=torch.uint8)
    dest = torch.zeros((12, 64), dtype=torch.uint8)
    dest_rows, src_rows = [9, 0, 1, 2, 7, 5, 11, 3], [0, 4, 5, 6, 11, 2, 9, 1]  # 6 runs
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy_rows(dest, dest_rows, src, src_rows)
    finally:
        torch.set_num_threads(before)
    for d, s_row in zip(dest_rows, src_rows):
        assert torch.equal(dest[d], src[s_row])
    untouched = [r for r in range(12) if r not in dest_rows]
    assert not dest[untouched].any()
    assert foreach_calls == [6]


def test_a_lend_in_many_runs_lands_every_block():
    transfers = TransferEngine(LAYOUT.allocate(16))
    slab = torch.randint(0, 256, (16, LAYOUT.block_nbytes), dtype=torch.uint8)
    blocks, rows = [15, 3, 8, 9, 10, 0, 6, 12], [2, 7, 0, 1, 14, 9, 11, 4]
    released = []
    job = transfers.load(blocks, fill_with({}), lend_rows(slab, rows, released))
    assert job.wait(10) and job.served == [True] * len(blocks) and released == [1]
    for block, row in zip(blocks, rows):
        assert torch.equal(as_bytes(transfers.kv_cache[block]), slab[row])
    transfers.close()


def test_blocks_not_lent_are_filled():
    transfers = engine()
    job = transfers.load([1, 2], fill_with({0: 5, 1: 6}), lambda start, n: None)
    assert job.wait(10) and job.served == [True, True]
    assert bool((as_bytes(transfers.kv_cache[1]) == 5).all()) and bool((as_bytes(transfers.kv_cache[2]) == 6).all())
    transfers.close()


def test_a_failing_read_is_reported_as_unserved_blocks_not_raised():
    transfers = engine()

    def broken(start, views):
        raise OSError("disk went away")

    job = transfers.load([1, 2, 3], broken)
    assert job.wait(10)
    assert job.failed and job.served == [False, False, False]
    # the worker survives: the next job runs
    assert transfers.load([1], fill_with({0: 3})).wait(10)
    transfers.close()


def test_a_store_reads_the_blocks_before_wait_copied_returns():
    transfers = engine()
    kv = transfers.kv_cache
    as_bytes(kv[4]).fill_(42)
    kept = []
    gate = threading.Event()

    def drain(start, views):
        assert gate.wait(10)
        kept.extend(v.clone() for v in views)

    job = transfers.store([4], drain)
    assert not job.copied
    gate.set()
    job.wait_copied()
    as_bytes(kv[4]).fill_(0)  # the slot may be reused now: the copy already has its bytes
    assert job.wait(10) and bool((kept[0] == 42).all())
    transfers.close()


def test_wait_any_returns_when_one_job_lands_and_times_out_otherwise():
    transfers = engine()
    gate = threading.Event()
    slow = transfers.load([0], fill_with({0: 1}, gate))
    assert not transfers.wait_any([slow], timeout=0.05)
    gate.set()
    assert transfers.wait_any([slow], timeout=10)
    transfers.close()


def test_an_empty_job_is_done_at_once():
    transfers = engine()
    assert transfers.load([], fill_with({})).done
    assert transfers.store([], lambda start, views: None).done
    transfers.close()


# A layout of 1 MiB blocks: a load of 12 is filled in 3 parts of 4 MiB (`MIN_FILL_PART_BYTES`) by 3 threads.
BIG = BlockLayout(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64, dtype=torch.float32)


def test_a_large_load_is_filled_in_parts_by_several_threads_at_once():
    transfers = TransferEngine(BIG.allocate(12), fill_threads=3)
    all_parts_at_once = threading.Barrier(3, timeout=10)  # passes only if 3 parts are filled together
    parts = []

    def fill(start, views):
        parts.append((start, len(views)))
        all_parts_at_once.wait()
        for i, view in enumerate(views):
            view.fill_(start + i)
        return [True] * len(views)

    job = transfers.load(list(range(11, -1, -1)), fill)  # block ids in reverse: part k fills blocks 11-4k..
    assert job.wait(10) and not job.failed and job.served == [True] * 12
    assert sorted(parts) == [(0, 4), (4, 4), (8, 4)]
    for position, block_id in enumerate(range(11, -1, -1)):
        assert bool((as_bytes(transfers.kv_cache[block_id]) == position).all())
    small = transfers.load([0, 1], fill_with({0: 5, 1: 6}))  # below one part's size: one fill call
    assert small.wait(10) and small.served == [True, True]
    transfers.close()


def test_a_large_lent_load_is_copied_in_parts_a_run_at_a_time_each_block_from_its_own_row():
    transfers = TransferEngine(BIG.allocate(12), fill_threads=3)
    slab = torch.randint(0, 256, (16, BIG.block_nbytes), dtype=torch.uint8)
    ids, rows = [11, 10, 3, 4, 5, 0, 1, 2, 9, 6, 7, 8], [0, 2, 4, 5, 6, 9, 10, 11, 15, 12, 13, 14]
    released, copies = [], []
    copy = np.copyto

    def noted_copy(dest, src):
        copies.append(threading.get_ident())
        copy(dest, src)

    np.copyto = noted_copy
    try:
        job = transfers.load(ids, lambda start, views: [False] * len(views), lend_rows(slab, rows, released))
        assert job.wait(10) and not job.failed and job.served == [True] * 12 and released == [1]
    finally:
        np.copyto = copy
    # parts [11 10 3 4], [5 0 1 2], [9 6 7 8] from rows [0 2 4 5], [6 9 10 11], [15 12 13 14]: 3 + 2 + 2 runs
    assert len(copies) == 7 and len(set(copies)) >= 2  # the load's worker and a helper, at least
    for block_id, row in zip(ids, rows):
        assert torch.equal(as_bytes(transfers.kv_cache[block_id]), slab[row])
    transfers.close()


def test_a_failing_part_fails_the_load_only_once_every_part_has_stopped_writing():
    transfers = TransferEngine(BIG.allocate(12), fill_threads=3)
    finished = []

    def fill(start, views):
        if start == 4:
            raise OSError("disk went away")
        time.sleep(0.2)  # the other parts are still writing when the failure is raised
        for view in views:
            view.fill_(1)
        finished.append(start)
        return [True] * len(views)

    job = transfers.load(list(range(12)), fill)
    assert job.wait(10)
    assert job.failed and job.served == [False] * 12
    assert sorted(finished) == [0, 8]  # both were done before the job was
    transfers.close()


# -- on a GPU (`pytest -m cuda`): pinned staging, a side stream per direction, events -----------------------------

CUDA_LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def fill_from(source: torch.Tensor):
    """A fill that writes row `start + i` of `source` (host bytes, one block a row) into view i."""
    def fill(start, views):
        for i, view in enumerate(views):
            view.copy_(source[start + i])
        return [True] * len(views)
    return fill


@pytest.mark.cuda
def test_on_cuda_blocks_loaded_through_pinned_staging_and_stored_back_equal_the_source():
    kv = CUDA_LAYOUT.allocate(16, device="cuda")
    # three blocks per staging half: a run of seven moves in three chunks, through both halves
    transfers = TransferEngine(kv, staging_bytes=6 * CUDA_LAYOUT.block_nbytes)
    ids = [9, 2, 14, 5, 0, 11, 7]
    source = torch.randint(0, 256, (len(ids), CUDA_LAYOUT.block_nbytes), dtype=torch.uint8)
    load = transfers.load(ids, fill_from(source))
    assert load.wait(60) and load.served == [True] * len(ids) and not load.failed
    for i, block in enumerate(ids):
        assert torch.equal(as_bytes(kv[block]).cpu(), source[i]), f"device block {block}"
    assert all(bool((kv[b] == 0).all()) for b in set(range(16)) - set(ids)), "a load wrote outside its blocks"

    stored = {}

    def drain(start, views):
        stored.update({start + i: view.clone() for i, view in enumerate(views)})

    store = transfers.store(ids, drain)
    assert store.wait(60) and not store.failed
    assert all(torch.equal(stored[i], source[i]) for i in range(len(ids)))
    transfers.close()


@contextlib.contextmanager
def tier_with_readers(name: str, layout, work_dir):
    """The disk or the remote tier (a valkey-server on a loopback port) with two reader processes."""
    if name == "disk":
        from kvstrata.tiers.disk import DiskTier
        tier = DiskTier(layout, str(work_dir / "kv"), 16 << 20, read_processes=2)
        yield tier
        tier.close()
        return
    from valkey_server import ValkeyServer

    from kvstrata.tiers.remote import RemoteTier
    with ValkeyServer() as server:
        tier = RemoteTier(layout, server.url, timeout=1.0, read_processes=2)
        yield tier
        tier.close()


@pytest.mark.cuda
@pytest.mark.parametrize("tier_name", ["disk", "remote"])
def test_on_cuda_blocks_read_by_reader_processes_into_shared_pinned_staging_land_as_stored(tmp_path, tier_name):
    from kvstrata.tiers.shared_memory import locate
    kv = CUDA_LAYOUT.allocate(16, device="cuda")
    transfers = TransferEngine(kv, staging_bytes=6 * CUDA_LAYOUT.block_nbytes, shared_staging=True)
    halves = transfers.shared_host_buffers()
    assert len(halves) == 2 and all(locate(h) is not None and h.is_pinned() for h in halves)
    ids = [9, 2, 14, 5, 0, 11, 7]  # three chunks, through both halves
    hashes, tokens = [bytes([i]) * 16 for i in ids], [[i] * CUDA_LAYOUT.block_size for i in ids]
    source = torch.randint(0, 256, (len(ids), CUDA_LAYOUT.block_nbytes), dtype=torch.uint8)
    with tier_with_readers(tier_name, CUDA_LAYOUT, tmp_path) as tier:
        tier.put(hashes, tokens, list(source))
        tier.flush()
        tier.share(kv, *halves)

        def fill(start, views):
            return tier.get(hashes[start:start + len(views)], tokens[start:start + len(views)], views)

        load = transfers.load(ids, fill)
        assert load.wait(60) and load.served == [True] * len(ids) and not load.failed
        assert all(torch.equal(as_bytes(kv[b]).cpu(), source[i]) for i, b in enumerate(ids))
        assert tier.stats().extra["blocks_read_by_processes"] == len(ids)
    transfers.close()


@pytest.mark.cuda
def test_on_cuda_blocks_lent_from_a_pinned_slab_land_as_the_source_and_are_released_after():
    kv = CUDA_LAYOUT.allocate(16, device="cuda")
    transfers = TransferEngine(kv, staging_bytes=6 * CUDA_LAYOUT.block_nbytes)  # three blocks a chunk
    slab = torch.randint(0, 256, (12, CUDA_LAYOUT.block_nbytes), dtype=torch.uint8).pin_memory()
    ids, rows = [4, 5, 6, 13, 0, 1, 9], [2, 3, 4, 0, 7, 8, 11]  # runs of neighbours and single blocks
    released = []

    def lend(start, n):  # the release checks that the copies from the rows have landed
        return LentBlocks(slab, rows[start:start + n],
                          lambda: released.append(all(torch.equal(as_bytes(kv[b]).cpu(), slab[r])
                                                      for b, r in zip(ids[start:start + n], rows[start:start + n]))))

    job = transfers.load(ids, fill_from(torch.zeros(len(ids), CUDA_LAYOUT.block_nbytes, dtype=torch.uint8)), lend)
    assert job.wait(60) and job.served == [True] * len(ids) and not job.failed
    assert released == [True, True, True], "a lent row was released before its copy landed"
    assert all(bool((kv[b] == 0).all()) for b in set(range(16)) - set(ids)), "a load wrote outside its blocks"
    transfers.close()


@pytest.mark.cuda
def test_on_cuda_a_store_copies_what_the_compute_stream_wrote_before_it_was_submitted():
    kv = CUDA_LAYOUT.allocate(4, device="cuda")
    transfers = TransferEngine(kv)
    torch.cuda._sleep(100_000_000)  # the compute stream is busy: the write below lands long after it is queued
    as_bytes(kv[1]).fill_(42)
    stored = []
    job = transfers.store([1], lambda start, views: stored.extend(v.clone() for v in views))
    assert job.wait(60)
    assert bool((stored[0] == 42).all()), "the store read the block before the step's write landed"
    transfers.close()


@pytest.mark.cuda
def test_on_cuda_a_load_lands_while_the_compute_stream_is_still_busy():
    """A load started while a step computes (in its shadow) copies beside the step, not after it: it writes free
    blocks only, which no queued step touches."""
    kv = CUDA_LAYOUT.allocate(4, device="cuda")
    transfers = TransferEngine(kv)
    transfers.allocate_staging()  # pinning and device allocations may wait for the device: done before it is busy
    source = torch.randint(0, 256, (2, CUDA_LAYOUT.block_nbytes), dtype=torch.uint8)
    transfers.load([1, 3], fill_from(torch.zeros_like(source))).wait()  # so may the first allocations on its stream
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of a busy compute stream
    job = transfers.load([1, 3], fill_from(source))
    assert job.wait(60) and job.served == [True, True]
    assert not compute.query(), "the load waited for the compute stream"
    compute.synchronize()
    assert all(torch.equal(as_bytes(kv[b]).cpu(), source[i]) for i, b in enumerate([1, 3]))
    transfers.close()


@pytest.mark.parametrize("fill_threads", [1, 2, 4, 8, 16])
def test_each_half_of_the_default_staging_gives_every_fill_thread_a_part(fill_threads):
    """A chunk is filled in parts of at least MIN_FILL_PART_BYTES, one per fill thread: with staging too small for
    all of them some threads sat idle (8 or 16 readers moved SmolLM2's blocks no faster than 4 on one H200)."""
    from kvstrata.tiers.transfer import MIN_FILL_PART_BYTES, MIN_STAGING_BYTES, default_staging_bytes

    staging = default_staging_bytes(fill_threads)
    assert staging >= MIN_STAGING_BYTES
    assert staging // 2 >= fill_threads * MIN_FILL_PART_BYTES


@pytest.mark.parametrize("tiers,allocated", [({"cpu": {"size": 16}}, True), ({"cpu": {"size": 0}}, False)])
def test_an_engine_with_lower_tiers_allocates_its_staging_at_start_not_on_its_first_write_down(tmp_path, monkeypatch,
                                                                                                tiers, allocated):
    """Page-locking staging holds the CUDA driver: allocated by the first write-down's worker, it stalled the step
    beside it by 33 ms on one H200. The engine allocates it while it starts, where it has lower tiers to move
    blocks to."""
    from kvstrata.engine.config import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    calls = []
    monkeypatch.setattr(TransferEngine, "allocate_staging", lambda self: calls.append(self))
    engine = LLMEngine(load_config({
        "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32"},
        "cache": {"tiers": {"device": {"size": 64}, "disk": {"path": str(tmp_path / "kv"), "size": 0}, **tiers}}}))
    try:
        assert calls == ([engine.hierarchy.transfers] if allocated else [])
    finally:
        engine.close()


@pytest.mark.cuda
def test_on_cuda_allocate_staging_pins_both_directions_before_any_job():
    kv = CUDA_LAYOUT.allocate(16, device="cuda")
    transfers = TransferEngine(kv, staging_bytes=6 * CUDA_LAYOUT.block_nbytes)
    transfers.allocate_staging()
    for direction in (transfers._loads, transfers._stores):
        assert direction.device is not None and all(half.is_pinned() for half in direction.host)
    ids = [3, 8]
    source = torch.randint(0, 256, (len(ids), CUDA_LAYOUT.block_nbytes), dtype=torch.uint8)
    load = transfers.load(ids, fill_from(source))  # a job uses the staging allocated ahead
    assert load.wait(10) and all(load.served)
    assert torch.equal(kv.view(torch.uint8).view(16, -1)[ids].cpu(), source)
    transfers.close()


@pytest.mark.parametrize("cores,on_gpu,expected", [(32, True, 16), (32, False, 4), (2, True, 2), (2, False, 2)])
def test_fill_threads_follow_the_cores_up_to_16_on_a_gpu_and_4_beside_a_model_on_the_cpu(monkeypatch, cores, on_gpu,
                                                                                         expected):
    """Readers on a GPU host move blocks the host's cores copy and check (16 readers doubled the 8B shape's disk
    promotions against 4 on one H200); on a CPU the same cores run the model's threads."""
    from kvstrata.tiers import transfer

    monkeypatch.setattr(transfer, "USABLE_CORES", cores)
    assert transfer.default_fill_threads(on_gpu) == expected
    if not on_gpu:  # a transfer engine over a host KV cache takes the CPU's default
        assert TransferEngine(BIG.allocate(4)).fill_threads == expected
