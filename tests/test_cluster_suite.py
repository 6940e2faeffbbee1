"""The cluster suite at its smallest (`benchmarks/cluster.py small`), as a user runs it: a real Valkey cluster
(three primaries, a replica each), two `kvstrata serve` replicas with their remote tier on it, `kvstrata route`
in front, and a primary killed mid-run. Every answer must be the uncached engine's, no request may fail or be
lost while the cluster fails over, and the remote tier must be back within the node timeout and a few seconds."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_process import REPO, server_env

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 2.0  # tests/valkey_server.py's cluster-node-timeout
A_FEW_S = 5.0


def test_a_valkey_primary_killed_mid_run_costs_no_request_and_no_wrong_answer(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/cluster.py", "small", "--out-dir", str(tmp_path)],
                         cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "cluster_small.json").read_text())
    failures = result["failures"]
    summary, recovery = failures["summary"], failures["recovery"]
    assert summary["requests"] >= 4
    assert (summary["wrong"], summary["error"], summary["lost"]) == (0, 0, 0), summary
    assert [name for _, name in failures["events"]] == ["Valkey primary killed", "replica promoted"]
    assert recovery["valkey_promoted_s"] is not None and recovery["valkey_promoted_s"] < NODE_TIMEOUT_S + 10
    # faults while the cluster fails over are misses, and they stop once it has
    faults_end = recovery["remote_faults_end_after_failover_s"]
    assert faults_end is None or faults_end <= NODE_TIMEOUT_S + A_FEW_S, recovery
    promoted = failures["events"][1][0]
    after = [o for o in failures["outcomes"] if o["sent_s"] > promoted]
    assert after and all(o["verdict"] == "correct" for o in after)
    assert sum(o["cached_by_tier"].get("device", 0) + o["cached_by_tier"].get("cpu", 0) for o in after) > 0
    # the router's /metrics counted every request it forwarded, each placed by the prefix its replica held or by load
    seen = failures["router"]
    assert sum(seen["placed"].values()) == summary["requests"] and set(seen["placed"]) <= {"prefix", "load"}
    assert seen["placed"].get("prefix", 0) > 0 and 0 < seen["held_share"] <= 1 and seen["refused"] == 0
    assert (tmp_path / "cluster_small.png").stat().st_size > 0
    assert "Valkey primary killed" in (tmp_path / "cluster_small.md").read_text()
