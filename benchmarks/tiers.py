"""The tiers and what moves between them: promotion and write-down bandwidth, chain hashing, the disk tier's
readers, promotion from a warm disk, the remote tier's lookup, and `cache.load_policy`.

    python benchmarks/tiers.py promotion --out benchmarks/results
    python benchmarks/tiers.py disk-readers --processes 1,2,4,8,16 --out-dir benchmarks/results

Retired (git keeps them; their reports are in results/archive/): `presence.py` (one `held` call per tier instead
of a `contains` per block: a document listing on the remote tier went from 203 ms to 6.4 ms on loopback) and
`lookup_beside_writes.py` (a CPU-tier put copies outside the tier's lock now: a lookup beside write-downs went
from 36-38 ms at the median to 0.04 ms).
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("promotion", "tiers.promotion", "CPU-tier and warm-disk promotion through the transfer engine as a "
               "share of memcpy, and disk write-down throughput"),
    Subcommand("hashing", "tiers.hashing", "chain hashing, ns per token: xxh3_128 and sha256 against vLLM's "
               "sha256+cbor2"),
    Subcommand("disk-readers", "tiers.disk_readers", "warm disk reads by 1 to N reader processes against their "
               "copies from memory"),
    Subcommand("disk-promotion", "tiers.disk_promotion", "a document promoted from a warm disk on the fill threads and "
               "on one; --baseline REV"),
    Subcommand("remote-lookup", "tiers.remote_lookup", "a remote-tier lookup: the server-side script against pipelined "
               "EXISTS"),
    Subcommand("load-policy", "tiers.load_policy", "TTFT of a lower-tier hit under always_load, always_recompute and "
               "auto"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
