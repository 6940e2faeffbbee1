"""`kvstrata bench scoring` (benchmarks/scoring.py) end to end on a tiny random-weight model: the
three engines score the same answers, the cached ones from the document's cached blocks."""
from __future__ import annotations

import json

import pytest

from server_process import run_bench_on_a_tiny_model


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_scoring_scores_every_answer_alike_and_the_cached_engines_reuse_the_document(tmp_path):
    out_dir = tmp_path / "results"
    done = run_bench_on_a_tiny_model("scoring", "configs/default.yaml", "--docs", "1", "--questions", "2",
                                     "--doc-tokens", "200", "--out-dir", str(out_dir))
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
