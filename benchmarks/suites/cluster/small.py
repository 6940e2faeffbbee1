"""`cluster.py small`: the cluster suite at its smallest (cluster_run.py's defaults for `small`): a Valkey cluster,
two replicas under placement by prefix, and one failover of a Valkey primary mid-run."""
from __future__ import annotations

from benchmarks.suites.cluster.run import main as run


def main(argv: list[str] | None = None) -> int:
    return run(argv, small=True)
