"""The CPU report (`benchmarks/ttft.py cpu-report`, `make cpu-report`): what someone with another CPU runs to settle the
CPU-speed goals there. Its goals are read from each part's own results, with the ratios those parts' reports print;
a part that fails or was never run says so and the others still count."""
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.suites.ttft import cpu_report as report

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# committed runs of each part's benchmark, and the ratios their reports (and results/README.md) quote
RUNS = {"one_thread": "cpu_vs_vllm_prefill_kernels.json", "all_threads": "cpu_vs_vllm_2threads_packed_once.json",
        "guidellm": "guidellm_vs_vllm_1GiB_prefill_kernels.json", "pressure": "ttft_pressure_vllm.json"}


def goal(result: dict, part: str, name: str) -> dict:
    (found,) = [g for g in result["goals"] if g["part"] == part and name in g["name"]]
    return found


def test_goals_are_the_ratios_each_parts_own_report_gives(tmp_path):
    for part, file in RUNS.items():
        shutil.copy(RESULTS / file, tmp_path / f"cpu_report_avx2_{part}.json")
    result, lines = report.summarize(str(tmp_path), "cpu_report_avx2", "avx2", {})
    expected = {("one_thread", "1 thread(s), float32: a miss"): 0.83, ("one_thread", "bfloat16: a miss"): 0.17,
                ("one_thread", "float32: a decoded token"): 1.02, ("one_thread", "bfloat16: a device hit"): 0.05,
                ("all_threads", "2 thread(s), float32: a miss"): 0.89,
                ("all_threads", "float32: a decoded token"): 0.86,
                ("guidellm", "output throughput"): 1.44, ("guidellm", "TTFT median"): 0.20,
                ("guidellm", "TTFT p95"): 0.61, ("pressure", "prefix caching in the same bytes"): 0.03,
                ("pressure", "after a restart"): 0.11, ("pressure", "a miss"): 0.96}
    for (part, name), value in expected.items():
        found = goal(result, part, name)
        assert round(found["value"], 2) == value, (part, name)
        assert found["status"] == "PASS"
    assert goal(result, "one_thread", "float32: a decoded token")["target"] == 1.1
    assert goal(result, "one_thread", "float32: a device hit")["target"] == 1.0
    # parts with no results of their own: said so, and no goal of theirs read as met
    assert result["parts"]["tests"]["status"] == "not run" and result["parts"]["invariant_mode"]["status"] == "not run"
    assert "| tests | not run | – | – | – |" in lines
    assert not [g for g in result["goals"] if g["part"] in ("tests", "invariant_mode")]
    assert result["parts"]["pressure"]["commit"] == "54fdb6d"
    assert any(line.startswith("| guidellm | guidellm: TTFT p95, ours / vLLM | 0.61x | <= 1.0 | yes |")
               for line in lines)


def test_a_part_that_fails_says_so_and_the_others_still_count(tmp_path, monkeypatch, capsys):
    writes = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(report.REPO_ROOT)!r})
        from benchmarks.lib import results
        run = {{"dtype": "float32", "prompt_tokens": 2048, "ttft_ratio": 1.2, "step_ratio": 1.7}}
        results.write(sys.argv[1], results.record(sys.argv[2], runs=[run]), ["# cost"], sys.argv[2])
        """)
    monkeypatch.setattr(report, "PARTS", (
        report.Part("one_thread", report.side_by_side_goals, lambda out_dir, stem: ["-c", "raise SystemExit(3)"]),
        report.Part("invariant_mode", report.invariant_mode_goals, lambda out_dir, stem: ["-c", writes, out_dir, stem]),
    ))
    status = report.main(["--parts", "one_thread,invariant_mode", "--out-dir", str(tmp_path), "--name", "r"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["parts"]["one_thread"]["status"] == "exited with status 3; it wrote no results"
    assert result["parts"]["invariant_mode"]["status"] == "ran"
    assert goal(result, "invariant_mode", "prefill")["status"] == "PASS"
    assert goal(result, "invariant_mode", "decode step")["status"] == "MISS"
    assert status == 1  # a goal missed
    assert "| invariant_mode | batch-invariant mode, float32: a decode step | 1.70x | <= 1.5 | no |" in \
        (tmp_path / "r.md").read_text()


def test_the_kernel_tests_part_counts_what_failed(tmp_path, monkeypatch):
    tests = tmp_path / "test_fake_kernels.py"
    tests.write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 1 == 2, 'other bits'\n")
    monkeypatch.setattr(report, "KERNEL_TESTS", (str(tests),))
    out = tmp_path / "out"
    report.run_tests(str(out), "r_tests", timeout_s=300)
    result, _ = report.summarize(str(out), "r", "avx2", {"tests": {"status": "ran"}})
    (failed,) = [g for g in result["goals"] if g["part"] == "tests"]
    assert failed["value"] == 1 and failed["status"] == "MISS" and "of 1 passed" in failed["name"]
    assert result["parts"]["tests"]["command"] == f"python -m pytest -q -p no:cacheprovider {tests}"


def test_parts_are_named_and_a_dry_run_runs_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main(["--parts", "one_thread,gpu"])
    assert "unknown gpu" in capsys.readouterr().err
    assert report.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"{sys.executable} benchmarks/ttft.py vllm --dtype float32 bfloat16" in printed
    assert "--name cpu_report_" in printed and not list(tmp_path.iterdir())


def test_the_invariant_mode_part_reads_what_batch_cost_writes(tmp_path):
    """The real subcommand's JSON (the embedded model, a short prompt), read as the report reads it."""
    from benchmarks.suites.invariance import batch

    batch.main(["cost", "--length", "48", "--tokens", "3", "--repeats", "1", "--dtypes", "float32",
                "--out-dir", str(tmp_path), "--name", "cost"])
    result = json.loads((tmp_path / "cost.json").read_text())
    assert result["command"].startswith("python ") and result["source"]["commit"]
    goals = report.invariant_mode_goals(result)
    assert [g.name for g in goals] == ["batch-invariant mode, float32: a 48-token prefill",
                                       "batch-invariant mode, float32: a decode step"]
    assert all(g.value > 0 and g.status in ("PASS", "MISS") for g in goals)
