"""The router-start benchmark (`benchmarks/host.py router-start`), one run of this commit's code: it starts the
router in a process of its own and reports its start and peak memory, and that it imported no torch."""
from __future__ import annotations

import json

import pytest

from benchmarks import host


@pytest.mark.slow
def test_one_start_of_this_commits_router_is_timed_and_imports_no_torch(tmp_path, embedded_model_fp32):
    # the fixture has converted the embedded model's tokenizer, as any start before a router's has
    assert host.main(["router-start", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "router_start.json").read_text())["runs"]["this"]
    assert run["torch_imported"] is False and 0 < run["start_s"] and run["max_rss_mb"] > 0
    assert "| this commit |" in (tmp_path / "router_start.md").read_text()
