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


def test_where_vllm_did_not_run_the_goals_are_held_against_transformers_and_say_so(tmp_path):
    """On a CPU where vLLM cannot run, the side-by-side and pressure goals divide ours by transformers' `generate`
    (sdpa), the floor, and each such goal's name says so; guidellm's, with no server beside ours, read N/A."""
    def side(miss, hit, decode):
        return {"miss_s": miss, "hit_s": hit, "decode_s_per_token": decode, "answers": [], "cached": []}

    one_thread = {"threads": 1, "runs": [{"dtype": "float32", "notes": ["vLLM not measured: no wheel"],
                                          "sides": {"kvstrata": side([1.5], [0.05], [0.03]),
                                                    "transformers": side([2.0], [2.0], [0.04])}}]}

    def records(*ttfts, hit_tier="device"):
        return [{"ttft_s": t, "hit_tier": hit_tier} for t in ttfts]

    pressure = {"configurations": {"recompute": {"records": records(2.4, 2.4, hit_tier="miss")},
                                   "device_cpu": {"records": records(0.1, 0.1)},
                                   "disk_after_restart": {"records": records(0.3, 0.3, hit_tier="disk")}},
                "peers": {"vllm_recompute": {"available": False, "reason": "vLLM not measured: no wheel"},
                          "hf_generate": {"available": True, "records": records(2.0, 2.0, hit_tier=None)}}}
    guidellm = {"goals": [{"name": "output throughput, ours / vLLM", "value": None, "target": 1.0,
                           "direction": ">="}]}
    for part, found in (("one_thread", one_thread), ("pressure", pressure), ("guidellm", guidellm)):
        (tmp_path / f"r_{part}.json").write_text(json.dumps(found))
    result, lines = report.summarize(str(tmp_path), "r", "portable", {})
    floor = [g for g in result["goals"] if g["part"] in ("one_thread", "pressure")]
    assert len(floor) == 7 and all(report.FLOOR_SAYS in g["name"] for g in floor)
    assert all(g["denominator"] == "transformers'" for g in floor)
    values = {g["name"].split(": ")[-1]: round(g["value"], 3) for g in floor}
    assert values == {"a miss's TTFT": 0.75, "a decoded token": 0.75, "a device hit's TTFT": 0.025,
                      "TTFT p50, our device + CPU tiers / every prompt prefilled": 0.05,
                      "TTFT p50 after a restart, our disk tier / every prompt prefilled": 0.15,
                      "a miss (recompute p50)": 1.2, "a device hit (p50)": 0.05}
    assert goal(result, "pressure", "a miss (recompute p50)")["status"] == "MISS"  # 1.2x the floor: above 1.1x
    assert goal(result, "guidellm", "output throughput")["status"] == "N/A"


def test_with_vllm_there_the_floor_beside_it_changes_no_goal(tmp_path):
    """The pressure part runs transformers too; where vLLM ran, its goals are still vLLM's."""
    shutil.copy(RESULTS / RUNS["pressure"], tmp_path / "r_pressure.json")
    before, _ = report.summarize(str(tmp_path), "r", "avx2", {})
    found = json.loads((tmp_path / "r_pressure.json").read_text())
    found["peers"]["hf_generate"] = {"available": True, "records": [{"ttft_s": 50.0, "hit_tier": None}]}
    (tmp_path / "r_pressure.json").write_text(json.dumps(found))
    after, _ = report.summarize(str(tmp_path), "r", "avx2", {})
    assert [(g["name"], g["value"]) for g in after["goals"]] == [(g["name"], g["value"]) for g in before["goals"]]
    assert not any(report.FLOOR_SAYS in g["name"] for g in after["goals"])
