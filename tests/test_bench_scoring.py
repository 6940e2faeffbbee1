"""`kvstrata bench scoring` (benchmarks/scoring.py) end to end on a tiny random-weight model: the
three engines score the same answers, the cached ones from the document's cached blocks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_scoring_scores_every_answer_alike_and_the_cached_engines_reuse_the_document(tmp_path):
    out_dir = tmp_path / "results"
    command = [sys.executable, "-c", "from kvstrata.cli import main; raise SystemExit(main())",
               "bench", "scoring", "--config", "configs/default.yaml",
               # random weights of a tiny shape: the benchmark's logic does not depend on the model
               "--set", "model.load_format=dummy", "--set", "model.name=tiny-llama", "--set", "model.dtype=float32",
               "--docs", "1", "--questions", "2", "--doc-tokens", "200", "--out-dir", str(out_dir)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((out_dir / "scoring.json").read_text())
    assert set(result["results"]) == {"recompute", "cached", "cached_batched"}
    for name, records in result["results"].items():
        assert len(records) == 8, name  # 2 questions x 4 answers
    summary = result["summary"]
    assert summary["recompute"]["other_answers_mean_cached_tokens"] == 0
    assert summary["cached"]["other_answers_mean_cached_tokens"] >= 160  # the 200-token document, but a block
    assert summary["cached_batched"]["other_answers_mean_cached_tokens"] > 0
    assert result["scores"]["max_abs_score_difference"] < 1e-3 and result["scores"]["same_best_answers"]
    assert (out_dir / "scoring.md").read_text().startswith("# Scoring answers on long documents")
