"""The GPU diagnostics on the CPU (small shapes, a two-layer random model): every part runs and records what its
readers of `diag.json` read: promotions that served every block, hits served from the disk tier after a restart
with the steps that served them, a decode stream's gaps around a CPU-tier hit, and CPU-tier hits alone."""
import json

import pytest

from benchmarks import gpu_diag

pytestmark = pytest.mark.slow


def test_every_part_records_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_diag, "STAGING_CASES", [(2, 2, 64)])
    assert gpu_diag.main(["--parts", "a,b,c,d", "--models", "tiny", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "diag.json").read_text())
    assert [(r["readers"], r["threads"]) for r in result["a"]] == [(2, 2), (2, 2)]  # both block shapes
    assert all(r["first_gbps"] > 0 and r["best_gbps"] > 0 for r in result["a"])
    for policy, run in result["b"]["tiny-llama"].items():
        assert [h["kind"] for h in run["hits"]] == ["first after restart", "warm engine", "warm engine"]
        for hit in run["hits"]:
            assert hit["cached"]["disk"] + hit["recomputed"]["disk"] > 0  # found on disk
            assert hit["steps"] and all(s["total"] >= s["sched"] for s in hit["steps"])
    for run in result["c"]["tiny-llama"]:
        assert run["gaps_ms"] and run["hit_ttft_ms"] > 0 and run["steps"]
        assert any("prepare" in step for step in run["steps"])  # the next step's admission work, timed
    for policy in ("auto", "always_load"):
        run = result["d"]["tiny-llama"][policy]
        assert len(run["hits"]) == 3 and run["step_cost"]["per_token_us"] >= 0
        for hit in run["hits"]:
            assert hit["cached"]["cpu"] + hit["recomputed"]["cpu"] > 0 and hit["steps"]
