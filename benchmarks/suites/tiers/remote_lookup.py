"""What a remote-tier lookup costs: `count_prefix` over a document's chain of hashes on one Valkey server, with the
lookup script (how the tier looks up on a server that runs scripts) and one pipelined EXISTS per hash (how it looks
up in a cluster, or on a server that refuses scripts), side by side in one run against the same server.

A lookup runs on the step thread's path: the scheduler waits for it when it orders or admits a request. Its client
side is Python; the step thread needs the interpreter lock for it.

    python benchmarks/tiers.py remote-lookup [--out-dir benchmarks/results]
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

import torch  # noqa: E402

from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from kvstrata.tiers.base import BlockLayout  # noqa: E402
from kvstrata.tiers.remote import RemoteTier  # noqa: E402
from benchmarks.lib import options  # noqa: E402

LAYOUT = BlockLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
CHAINS = (16, 128, 437, 512)  # blocks: 256, 2048, 7000 (a long document of the development set) and 8192 tokens
HELD = (("all held", 1.0), ("half held", 0.5), ("none held", 0.0))
NO_SCRIPTS_USER, NO_SCRIPTS_PASSWORD = "lookups-without-scripts", "benchmark-only"


def timed_lookups(tier: RemoteTier, chain: list[bytes], lookups: int) -> tuple[float, float]:
    """(median seconds of a lookup, this process's CPU seconds per lookup)."""
    seconds = []
    cpu = time.process_time()
    for _ in range(lookups):
        started = time.perf_counter()
        tier.count_prefix(chain)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), (time.process_time() - cpu) / lookups


def measure(lookups: int) -> list[dict]:
    from tests.valkey_server import ValkeyServer

    rows = []
    with ValkeyServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", NO_SCRIPTS_USER, "on", f">{NO_SCRIPTS_PASSWORD}", "~*", "+@all",
                              "-@scripting")
        by_script = RemoteTier(LAYOUT, server.url, timeout=5.0)
        by_exists = RemoteTier(LAYOUT, server.url.replace("redis://", f"redis://{NO_SCRIPTS_USER}:"
                                                          f"{NO_SCRIPTS_PASSWORD}@"), timeout=5.0)
        for num_blocks in CHAINS:
            for held_name, fraction in HELD:
                chain = [os.urandom(16) for _ in range(num_blocks)]
                held = chain[:int(num_blocks * fraction)]
                for h in held:
                    admin.set(by_script._key(h), b"x")  # a lookup reads keys only, never their values
                assert by_script.count_prefix(chain) == by_exists.count_prefix(chain) == len(held)
                script_s, script_cpu = timed_lookups(by_script, chain, lookups)
                exists_s, exists_cpu = timed_lookups(by_exists, chain, lookups)
                rows.append({"blocks": num_blocks, "held": held_name, "script_s": script_s,
                             "script_cpu_s": script_cpu, "exists_s": exists_s, "exists_cpu_s": exists_cpu})
        assert by_exists.stats().extra["faults"] == by_script.stats().extra["faults"] == 0
        by_script.close()
        by_exists.close()
    return rows


def report(result: dict) -> list[str]:
    lines = ["# A remote-tier lookup: one script against one EXISTS per hash", "", *provenance_lines(result), "",
             f"`count_prefix` over a chain of random hashes on one local valkey-server, the chain held in full, up to "
             f"its middle, or not at all; median of {result['lookups']} lookups each way, in turn against the same "
             f"server. CPU: this process's CPU time per lookup (the server's is not counted).", "",
             "| blocks | tokens | held | script ms | CPU ms | EXISTS per hash ms | CPU ms | EXISTS / script |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['blocks']} | {row['blocks'] * LAYOUT.block_size} | {row['held']} | "
                     f"{row['script_s'] * 1e3:.2f} | {row['script_cpu_s'] * 1e3:.2f} | {row['exists_s'] * 1e3:.2f} | "
                     f"{row['exists_cpu_s'] * 1e3:.2f} | {row['exists_s'] / row['script_s']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = options.parser(__doc__)
    parser.add_argument("--lookups", type=int, default=50)
    options.out_dir(parser, help="write remote_lookup.md and .json there")
    args = parser.parse_args(argv)
    result = results.record("remote_lookup", lookups=args.lookups, rows=measure(args.lookups))
    results.publish(result, report(result), args.out_dir)
