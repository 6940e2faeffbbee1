"""The GPU diagnostics (`benchmarks/gpu.py diag`) on the CPU (small shapes, a two-layer random model): every part runs and records what its
readers of `diag.json` read: promotions that served every block, hits served from the disk tier after a restart
with the steps that served them, a decode stream's gaps around a CPU-tier hit, CPU-tier hits alone, and copies of a
document in groups of layers beside a modelled question."""
import json

import pytest

from benchmarks import gpu
from benchmarks.suites.gpu import diag as gpu_diag

pytestmark = pytest.mark.slow


def test_every_part_records_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_diag, "STAGING_CASES", [(2, 2, 64)])
    assert gpu.main(["diag", "--parts", "a,b,c,d,e", "--models", "tiny", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "diag.json").read_text())
    assert [(r["readers"], r["threads"]) for r in result["a"]] == [(2, 2), (2, 2)]  # both block shapes
    assert all(r["first_gbps"] > 0 and r["best_gbps"] > 0 for r in result["a"])
    for r in result["a"]:  # the last promotion's fill parts: each chunk's span holds its parts
        assert r["last_by_chunk"] and all(
            c["parts"] >= 1 and c["began_ms"] <= c["ended_ms"] and c["median_part_ms"] <= c["slowest_part_ms"]
            for c in r["last_by_chunk"])
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
    for layout, run in result["e"].items():
        layers = {"SmolLM2-135M": 30, "Llama-3-8B": 32}[layout]
        # every copy moved the document's bytes (checked), in each mode and count of groups
        assert [(c["mode"], c["groups"]) for c in run["copies"]] == [
            (mode, g) for mode in ("per_block", "2d") for g in (1, 2, 4, 8, layers)]
        assert all(c["gbps"] > 0 and 0 < c["first_group_ms"] <= c["total_ms"] for c in run["copies"])
        for trial in run["overlap"]:
            assert all(trial[k] > 0 for k in ("compute_alone_ms", "copy_then_compute_ms", "layer_by_layer_ms"))
        assert run["graph"] is None  # a CUDA graph's waits: on a GPU only
