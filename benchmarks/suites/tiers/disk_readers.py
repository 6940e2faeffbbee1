"""How a warm disk tier's reads scale with processes, and with what they stop scaling.

N processes each read their share of a store's blocks as the disk tier's reader processes do
(tiers/disk_reader.py: one LMDB read transaction, each record's header compared with the expected one, its payload
copied into memory this process writes and the copy's checksum taken, tiers/record_check.py), twice: the first pass
maps the store's pages into the process (page-table faults on a warm page cache), the second finds them mapped.
Beside them, the same processes copy and checksum as many bytes from memory of their own (what the host's cores
and memory allow without the store). The store is written by the disk tier itself and read once before timing
(its pages warm). GB/s are summed over the processes: the bytes read over the time from the common start to the
last one's end.

On the H200 host of benchmarks/results/gpu.md, 4, 8 and 16 reader processes read warm disk blocks at about the
same 7-11 GB/s (13-20% of the host-to-device copy), not more with more processes: this benchmark, run on such a
host (it needs no GPU), says whether the store's reads (its faults included) or the copies themselves stop there.

    python benchmarks/tiers.py disk-readers --processes 1,2,4,8,16 --out-dir benchmarks/results
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib import options  # noqa: E402

LAYOUTS = {"SmolLM2-135M": (30, 3, 64), "Llama-3-8B": (32, 8, 128)}  # layers, KV heads, head dim (bf16, 16 tokens)
RING_BYTES = 64 << 20  # where a process copies to (and, for the memory copy, from): larger than a cache
BARRIER_TIMEOUT_S = 60.0  # the longest a process waits for the others to start a pass


def build_store(path: str, layout_name: str, total_bytes: int) -> dict:
    """A disk store of random blocks of the layout, written by the disk tier; what a reader needs to read them."""
    import torch

    from kvstrata.tiers.base import BlockLayout, as_bytes
    from kvstrata.tiers.disk import DiskTier
    from kvstrata.tiers.record import RecordCodec

    layers, kv_heads, head_dim = LAYOUTS[layout_name]
    layout = BlockLayout(num_layers=layers, block_size=16, num_kv_heads=kv_heads, head_dim=head_dim,
                         dtype=torch.bfloat16)
    codec = RecordCodec(layout)
    num_blocks = max(1, total_bytes // layout.block_nbytes)
    keys = [os.urandom(16) for _ in range(num_blocks)]
    tokens = [[(7 * i + t) % 49152 for t in range(16)] for i in range(num_blocks)]
    tier = DiskTier(layout, path, 2 * num_blocks * codec.record_nbytes + (64 << 20), read_processes=0)
    payload = as_bytes(layout.allocate(1)[0]).clone()
    for start in range(0, num_blocks, 64):
        stop = min(start + 64, num_blocks)
        srcs = [payload.random_(0, 256).clone() for _ in range(start, stop)]
        tier.put(keys[start:stop], tokens[start:stop], srcs)
        tier.flush()
    tier.close()
    return {"keys": keys, "heads": [codec.head(t) for t in tokens], "header": codec.header_nbytes,
            "record": codec.record_nbytes, "block_nbytes": layout.block_nbytes}


def warm(path: str) -> None:
    """Read the store's file once, so that its pages are in the page cache (a warm disk tier)."""
    with open(os.path.join(path, "data.mdb"), "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def read_share(path: str, store: dict, share: range, start_at, results) -> None:
    """One process: its share of the blocks read from the store twice, then as many bytes copied from its own
    memory; each timed from the common start (`start_at`, a barrier) to its end. A failure is reported, not
    left for the others to wait on."""
    try:
        results.put(_timed_reads(path, store, share, start_at))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        start_at.abort()  # the others stop waiting for this one
        results.put(f"{type(e).__name__}: {e}")


def _timed_reads(path: str, store: dict, share: range, start_at) -> list[tuple[float, float]]:
    import lmdb
    import numpy as np
    import xxhash

    from kvstrata.tiers.lmdb_store import SUBDBS, LmdbStore
    from kvstrata.tiers.record_check import checked_payload, copy_checked

    env = lmdb.open(path, readonly=True, lock=True, max_dbs=len(SUBDBS), subdir=True, map_size=0)
    lmdb_store = LmdbStore(path, env, create=False)
    payload_nbytes = store["record"] - store["header"]
    ring = np.ones(RING_BYTES, dtype=np.uint8)  # touched: no first-write faults in what is timed
    slots = max(1, RING_BYTES // payload_nbytes)
    timings = []
    for _ in range(2):
        start_at.wait(BARRIER_TIMEOUT_S)
        started = time.perf_counter()
        with lmdb_store.begin(db=lmdb_store.blocks) as txn:
            for n, k in enumerate(share):
                slot = (n % slots) * payload_nbytes
                record = txn.get(store["keys"][k])
                copy_checked(*checked_payload(record, store["heads"][k], store["header"], store["record"]),
                             ring[slot:slot + payload_nbytes])
        timings.append((started, time.perf_counter()))
    source = np.ones(RING_BYTES, dtype=np.uint8)
    start_at.wait(BARRIER_TIMEOUT_S)
    started = time.perf_counter()
    for n in range(len(share)):  # the same copies and checksums, from this process's own memory
        slot = (n % slots) * payload_nbytes
        np.copyto(ring[slot:slot + payload_nbytes], source[slot:slot + payload_nbytes])
        xxhash.xxh3_64_intdigest(ring[slot:slot + payload_nbytes])
    timings.append((started, time.perf_counter()))
    lmdb_store.close()
    return timings


def measure(path: str, store: dict, processes: int) -> dict:
    """GB/s summed over `processes` readers: the store's first pass, its second, and the memory copy."""
    context = multiprocessing.get_context("spawn")  # nothing of this process (threads, CUDA) is inherited
    num_blocks = len(store["keys"])
    shares = [range(num_blocks * p // processes, num_blocks * (p + 1) // processes) for p in range(processes)]
    start_at, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=read_share, args=(path, store, share, start_at, results)) for share in shares]
    for w in workers:
        w.start()
    timings = [results.get(timeout=10 * BARRIER_TIMEOUT_S) for _ in workers]
    for w in workers:
        w.join()
    failures = [t for t in timings if isinstance(t, str)]
    if failures:  # the one that failed first, not those it left at a broken barrier
        cause = next((f for f in failures if not f.startswith("BrokenBarrierError")), failures[0])
        raise RuntimeError(f"a reader process failed: {cause}")
    nbytes = num_blocks * (store["record"] - store["header"])
    gbps = [nbytes / (max(t[i][1] for t in timings) - min(t[i][0] for t in timings)) / 1e9 for i in range(3)]
    return {"processes": processes, "first_pass_gbps": gbps[0], "second_pass_gbps": gbps[1], "memory_gbps": gbps[2]}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    parser.add_argument("--processes", default="1,2,4,8,16", help="counts of reader processes, comma separated")
    parser.add_argument("--gib", type=float, default=1.0, help="the store's size per layout, GiB")
    options.out_dir(parser, help="write disk_read_scaling.md and .json here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.processes.split(",")]
    rows = []
    for name in LAYOUTS:
        with tempfile.TemporaryDirectory(prefix="kvstrata-scaling-") as path:
            store = build_store(path, name, int(args.gib * (1 << 30)))
            warm(path)
            for processes in counts:
                row = {"layout": name, "blocks": len(store["keys"]), "block_nbytes": store["block_nbytes"],
                       **measure(path, store, processes)}
                print(f"{name}, {processes} processes: first pass {row['first_pass_gbps']:.2f} GB/s, second pass "
                      f"{row['second_pass_gbps']:.2f}, own memory {row['memory_gbps']:.2f}", flush=True)
                rows.append(row)
    result = results.record("disk_read_scaling", cpus=len(os.sched_getaffinity(0)), gib=args.gib, rows=rows)
    results.publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    lines = ["# Warm disk reads by several processes", "", *provenance_lines(result), "",
             f"Each layout's store of {result['gib']:g} GiB of random bf16 blocks, written by the disk tier and read "
             f"once before timing; this process may run on {result['cpus']} cores. Every process reads its share "
             "as a disk tier reader does (benchmarks/suites/tiers/disk_readers.py), twice, then copies and checksums as "
             "many bytes from its own memory. GB/s summed over the processes.", "",
             "| layout | processes | store, first pass GB/s | store, second pass GB/s | own memory GB/s | "
             "first pass / own memory |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['layout']} | {r['processes']} | {r['first_pass_gbps']:.2f} | {r['second_pass_gbps']:.2f} "
                     f"| {r['memory_gbps']:.2f} | {r['first_pass_gbps'] / r['memory_gbps']:.2f} |")
    return lines
