"""Replicas on a Valkey cluster behind the router, under load and failures, everything on this machine.

    python benchmarks/cluster.py run --out-dir benchmarks/results   # 3 primaries + 3 replicas, 3 kvstrata replicas
    python benchmarks/cluster.py small                              # 2 kvstrata replicas, one failover (a test runs it)

`run` sets placement by prefix against round robin and random on the same requests (tokens served locally, from
the remote tier and recomputed, the share of the best possible, TTFT, throughput, refusals), then kills a Valkey
primary, kills and restarts a kvstrata replica and cuts the router's event feed from one, each at a fixed second,
checking every answer against an uncached engine's and timing each recovery (benchmarks/suites/cluster/run.py).
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("run", "cluster.run", "placement by prefix against round robin and random, then three failures "
               "mid-run, with a timeline plot"),
    Subcommand("small", "cluster.small", "a Valkey cluster, two replicas, one failover: the suite in under a minute"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
