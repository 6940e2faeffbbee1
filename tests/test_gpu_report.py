"""The GPU report (`benchmarks/gpu.py report`, benchmarks/suites/gpu/report.py): it refuses to write GPU figures without CUDA, counts the CUDA tests from
their JUnit XML, judges each goal from measured ratios, and its `--smoke` run (every section on the CPU, tiny shapes)
writes a report with every section (slow)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import gpu  # noqa: E402
from benchmarks.lib.child_runs import junit_counts  # noqa: E402
from benchmarks.suites.kernels import decoder_step  # noqa: E402
from benchmarks.suites.gpu import report as gpu_report

SECTION_HEADINGS = ("## Device", "## Goals", "## CUDA tests (`pytest -m cuda`)", "## Copy bandwidth and promotion",
                    "## Prefix-prefill kernel", "## A model step: kvstrata's decoder against transformers' modules",
                    "## Single-request TTFT (long-document QA)",
                    "## A decode stream while a CPU-tier hit is admitted")


def test_without_cuda_the_report_refuses_in_one_line_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    assert gpu.main(["report", "--out", str(out)]) == 2  # as `benchmarks/gpu.py report` runs it
    err = capsys.readouterr().err
    assert "no CUDA device" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_smoke_run_must_not_replace_the_committed_gpu_report(capsys):
    with pytest.raises(SystemExit):
        gpu_report.main(["--smoke"])
    with pytest.raises(SystemExit):
        gpu_report.main(["--smoke", "--out", str(gpu_report.DEFAULT_OUT)])
    assert "--smoke needs --out" in capsys.readouterr().err


def test_unknown_sections_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_report.main(["--sections", "ttft,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_cuda_test_counts_come_from_the_junit_xml(tmp_path):
    junit = tmp_path / "cuda.xml"
    junit.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
        <testcase classname="tests.test_a" name="test_ok"/>
        <testcase classname="tests.test_a" name="test_bad"><failure message="x&#10;second line"/></testcase>
        <testcase classname="tests.test_b" name="test_broken"><error message="y"/></testcase>
        <testcase classname="tests.test_b" name="test_gpu"><skipped message="z"/></testcase>
        </testsuite></testsuites>""")
    counts = junit_counts(junit)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["not_passed"] == ["tests.test_a::test_bad", "tests.test_b::test_broken"]
    assert counts["why"] == {"tests.test_a::test_bad": "x", "tests.test_b::test_broken": "y"}


def cuda_tests_plan(*paths: Path) -> gpu_report.Plan:
    return gpu_report.Plan(False, "cuda", ("tests",), (), (), (64,), 1, 1 << 20, 64, 8, 2, tuple(map(str, paths)),
                           tests_timeout_s=120.0)


def test_a_test_module_that_cannot_be_imported_is_one_error_and_the_other_tests_still_run(tmp_path):
    # as on a GPU machine that lacks a serving dependency: its test modules fail to import
    (tmp_path / "test_needs_a_missing_package.py").write_text("import no_such_package_here\n")
    (tmp_path / "test_kernel.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_runs():\n    assert True\n")
    counts = gpu_report.run_cuda_tests(cuda_tests_plan(tmp_path))
    assert (counts["passed"], counts["errors"]) == (1, 1)
    assert any("test_needs_a_missing_package" in name for name in counts["not_passed"])


def test_when_pytest_runs_no_test_the_section_fails_saying_why(tmp_path):
    with pytest.raises(RuntimeError, match="pytest ran no test .*no_such_dir"):
        gpu_report.run_cuda_tests(cuda_tests_plan(tmp_path / "no_such_dir"))


def test_the_compiled_kernel_check_is_told_to_stop_ahead_of_the_tests_section_limit(tmp_path):
    (tmp_path / "test_deadline.py").write_text(
        "import os, time, pytest\n\n@pytest.mark.cuda\ndef test_deadline():\n"
        f"    left = float(os.environ['{gpu_report.CUDA_CHECK_DEADLINE_ENV}']) - time.time()\n"
        f"    assert 0 < left <= 120 - {gpu_report.TESTS_AFTER_CHECK_S}\n")
    counts = gpu_report.run_cuda_tests(cuda_tests_plan(tmp_path))
    assert (counts["passed"], counts["failed"]) == (1, 0), counts


def test_a_check_stopped_at_its_deadline_keeps_the_lines_it_printed_and_one_that_fails_says_why(tmp_path):
    from test_kernels_cuda import lines_until
    printing = "import sys, time\nprint('{\"case\": \"a\"}')\nprint('{\"case\": \"b\"}', flush=True)\ntime.sleep(60)"
    started = time.time()
    lines, stopped = lines_until([sys.executable, "-c", printing], dict(os.environ), started + 2, tmp_path / "err")
    assert lines == ['{"case": "a"}', '{"case": "b"}'] and stopped and time.time() - started < 30
    failing = "import sys\nprint('{\"case\": \"a\"}')\nsys.exit('no CUDA device here')"
    with pytest.raises(AssertionError, match="no CUDA device here"):
        lines_until([sys.executable, "-c", failing], dict(os.environ), time.time() + 60, tmp_path / "err2")


def ttft_row(model: str, miss: float, device: float, cpu: float, disk: float, short: float) -> dict:
    return {"model": model, "dtype": "bfloat16", "doc_tokens": 7050, "prompt_tokens": 7087,
            "median_s": {"miss": miss, "device": device, "cpu": cpu, "disk": disk, "short": short}}


def test_goals_are_judged_from_the_measured_ratios_and_unmeasured_ones_say_so():
    result = {"bandwidth": {"limits": {"h2d": {"gbps": 50.0}},
                            "rows": [{"block": "Llama-3-8B", "cpu_gbps": 45.0, "disk_gbps": 20.0}]},
              "ttft": [ttft_row("smollm2", miss=0.100, device=0.010, cpu=0.012, disk=0.025, short=0.008),
                       ttft_row("smollm2", miss=0.040, device=0.009, cpu=0.010, disk=0.050, short=0.008) | {
                           "doc_tokens": 3750}]}
    by_name = {g.name: g for g in gpu_report.goals(result)}
    assert by_name["promotion CPU tier -> device, Llama-3-8B block"].value == pytest.approx(0.9)
    assert by_name["promotion CPU tier -> device, Llama-3-8B block"].status == "PASS"
    assert by_name["promotion warm disk -> device, Llama-3-8B block"].status == "MISS"  # 40% < 50%
    smol = "SmolLM2 bf16, 7087 tokens"  # the longest document's row
    assert by_name[f"{smol}: device hit vs a cold 64-token prompt"].value == pytest.approx(1.25)
    assert by_name[f"{smol}: CPU-tier hit vs device hit"].status == "PASS"
    assert by_name[f"{smol}: warm disk hit vs device hit"].status == "MISS"  # 2.5x > 2x
    assert by_name[f"{smol}: miss vs CPU-tier hit"].value == pytest.approx(0.100 / 0.012)
    # the shorter row's disk hit (50 ms) is slower than its miss (40 ms)
    assert by_name["never slower than recomputing: the slowest hit vs the miss, worst row"].value == pytest.approx(1.25)
    assert by_name["Llama-3-8B shape bf16, ~7k tokens: miss vs CPU-tier hit"].status == "N/A"
    assert any(g.status == "N/A" and "decode gap" in g.name for g in by_name.values())


@pytest.mark.slow
def test_a_smoke_run_writes_every_section_of_the_report(tmp_path):
    out = tmp_path / "gpu.md"
    # one narrow cache stands in for both (fp8 and int8 take the same paths through the report)
    assert gpu_report.main(["--smoke", "--out", str(out), "--dtypes", "bfloat16,bfloat16/int8"]) == 0
    report = out.read_text()
    assert "Smoke run on the CPU" in report
    positions = [report.index(heading) for heading in SECTION_HEADINGS]
    assert positions == sorted(positions), "sections out of order"
    assert "Failed:" not in report and "not measured" not in report  # every goal got a value
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["tests"]["failed"] == 0 and result["tests"]["errors"] == 0
    assert result["tests"]["skipped"] > 0 if not torch.cuda.is_available() else result["tests"]["passed"] > 0
    assert [r["block"] for r in result["bandwidth"]["rows"]] == ["SmolLM2-135M", "Llama-3-8B"]
    for row in result["bandwidth"]["rows"]:  # the disk read as the engine reads it, in-process, and by other counts
        assert row["disk_gbps"] > 0 and row["disk_gbps_in_process"] > 0 and row["disk_gbps_by_readers"]["1"] > 0
    assert "Llama-3-8B, 1 reader:" in report
    assert len(result["kernels"]["paging"]) == 3 and len(result["kernels"]["split_kv"]) == 3  # header, rule, one row
    assert {(r["model"], r["case"]) for r in result["step"]} == {
        (m, case.name) for m in gpu_report.MODELS for case in decoder_step.CASES}
    assert all(r["decoder_s"] > 0 and r["transformers_s"] > 0 for r in result["step"])
    rows = result["ttft"]
    assert {(r["model"], r["dtype"], r["doc_tokens"]) for r in rows} == {
        (m, dtype, 64) for m in gpu_report.MODELS for dtype in ("bfloat16", "bfloat16/int8")}
    assert all(r["unexpected"] == [] for r in rows), "a request was not served by the tier it was meant to test"
    # each request's receipt: a miss and a device hit load nothing (a lower-tier hit may show no load either,
    # where its load policy recomputed a head while the rest loaded), each looked up and computed its question
    assert all(r["phases_ms"][kind]["load"] == 0 for r in rows for kind in ("short", "miss", "device"))
    assert all(min(r["phases_ms"][kind]["lookup"], r["phases_ms"][kind]["prefill"]) > 0
               for r in rows for kind in ("short", *gpu_report.KINDS))
    assert "Where the time to first token went" in report
    assert "| cold 64-token prompt |" in report  # beside the hits: what the host spends on a prompt of few blocks
    assert all(g["hit_cached_tokens_by_tier"]["cpu"] > 0 for g in result["gap"])


def test_a_hit_is_named_by_the_tier_its_prefix_was_found_in_even_when_the_load_policy_recomputed_part():
    def record(cached: dict, recomputed: dict) -> dict:
        tiers = ("device", "cpu", "disk", "remote")
        return {"prompt_tokens": 135, "cached_tokens_by_tier": {t: cached.get(t, 0) for t in tiers},
                "recomputed_tokens_by_tier": {t: recomputed.get(t, 0) for t in tiers}}

    # 64 tokens loaded from the CPU tier and 32 recomputed beside the load: a CPU-tier hit, not a miss
    assert gpu_report.found_tier(record({"cpu": 64}, {"cpu": 32})) == "cpu"
    assert gpu_report.found_tier(record({"cpu": 96}, {})) == "cpu"
    assert gpu_report.found_tier(record({"device": 16}, {"cpu": 16})) == "miss"  # too little found to be a hit
    assert gpu_report.found_tier(record({}, {})) == "miss"


def test_a_report_made_in_several_runs_keeps_what_each_measured(tmp_path):
    """`--merge`: a report too long for one sitting (a lent GPU runs a command for minutes, not an hour) is
    made of runs that each measure some sections, models or dtypes."""
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    assert gpu_report.main(["--smoke", "--sections", "bandwidth", "--out", str(first)]) == 0
    assert gpu_report.main(["--smoke", "--sections", "kernels", "--merge", str(first.with_suffix(".json")),
                            "--out", str(second)]) == 0
    result = json.loads(second.with_suffix(".json").read_text())
    assert result["plan"]["sections"] == ["bandwidth", "kernels"]
    assert result["bandwidth"] == json.loads(first.with_suffix(".json").read_text())["bandwidth"]
    assert result["kernels"]["split_kv"]
    report = second.read_text()
    assert "## Copy bandwidth and promotion" in report and "## Prefix-prefill kernel" in report
    assert "Merged with the figures of `python benchmarks/gpu.py report --smoke --sections bandwidth" in report


def test_ttft_rows_measured_again_replace_the_earlier_ones_and_the_others_stay():
    def run(sections, models, dtypes, rows):
        return {"command": "gpu_report " + ",".join(sections), "started_at": "t", "duration_s": 1.0,
                "source": {"commit": "abc"}, "device": {"name": "GPU"},
                "plan": {"smoke": False, "sections": sections, "models": models, "dtypes": dtypes,
                         "doc_tokens": [3750, 7050], "repeats": 3}, "ttft": rows, "gap": []}

    old_smol, old_llama = ttft_row("smollm2", 1, 1, 1, 1, 1), ttft_row("llama-3-8b", 2, 2, 2, 2, 2)
    earlier = run(["bandwidth", "ttft"], ["smollm2", "llama-3-8b"], ["bfloat16"], [old_smol, old_llama])
    earlier["bandwidth"] = {"rows": []}
    earlier["errors"] = {"bandwidth": "a failure worth keeping"}
    new_smol = ttft_row("smollm2", 3, 3, 3, 3, 3)
    result = run(["ttft"], ["smollm2"], ["bfloat16"], [new_smol])
    gpu_report.merge_earlier_run(earlier, result)
    assert result["ttft"] == [old_llama, new_smol]
    assert result["bandwidth"] == {"rows": []} and result["errors"] == {"bandwidth": "a failure worth keeping"}
    assert result["plan"]["sections"] == ["bandwidth", "ttft"] and result["plan"]["models"] == ["smollm2", "llama-3-8b"]
    assert result["merged_runs"] == [{"command": "gpu_report bandwidth,ttft", "started_at": "t", "duration_s": 1.0,
                                      "commit": "abc"}]


    # a model the time limit left out is not measured again: its earlier rows stay
    result = run(["ttft"], ["smollm2", "llama-3-8b"], ["bfloat16"], [new_smol])
    result["not_run_for_time"] = [{"model": "llama-3-8b", "dtype": "bfloat16"}]
    gpu_report.merge_earlier_run(earlier, result)
    assert result["ttft"] == [old_llama, new_smol]


def test_parts_not_started_within_the_time_limit_are_listed_and_the_report_is_still_written(tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_report.main(["--smoke", "--out", str(out), "--sections", "bandwidth,ttft", "--models", "smollm2",
                            "--dtypes", "bfloat16", "--time-limit", "0"]) == 0
    report = out.read_text()
    assert "Not run, the time limit (`--time-limit`) reached: bandwidth, smollm2 bfloat16." in report
    assert "## Copy bandwidth and promotion" not in report


def test_a_run_stopped_midway_keeps_the_sections_it_measured(tmp_path, monkeypatch):
    def stopped(plan):
        raise KeyboardInterrupt  # as a lent machine's time running out stops the run

    monkeypatch.setattr(gpu_report, "measure_kernels", stopped)
    out = tmp_path / "gpu.md"
    with pytest.raises(KeyboardInterrupt):
        gpu_report.main(["--smoke", "--out", str(out), "--sections", "bandwidth,kernels"])
    assert "## Copy bandwidth and promotion" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text())["bandwidth"]["rows"]


def test_figures_of_another_device_are_not_merged(tmp_path, capsys):
    first = tmp_path / "first.md"
    assert gpu_report.main(["--smoke", "--sections", "bandwidth", "--out", str(first)]) == 0
    earlier = json.loads(first.with_suffix(".json").read_text())
    earlier["device"]["name"] = "NVIDIA H100 80GB HBM3"
    first.with_suffix(".json").write_text(json.dumps(earlier))
    capsys.readouterr()
    second = tmp_path / "second.md"
    assert gpu_report.main(["--smoke", "--sections", "kernels", "--merge", str(first.with_suffix(".json")),
                            "--out", str(second)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two devices" in err[0]
    assert not second.exists()
    assert gpu_report.main(["--smoke", "--merge", str(tmp_path / "missing.json"), "--out", str(second)]) == 2


def test_a_run_with_another_block_size_is_its_own_report(tmp_path, capsys):
    """`--block-size`: every engine of the run keeps its KV in blocks of that many tokens, and the report says so;
    its TTFTs are not merged into a report measured with another size."""
    first = tmp_path / "first.md"  # (the smoke run's prompts are of 88 and 135 tokens: two or three blocks)
    assert gpu_report.main(["--smoke", "--sections", "ttft", "--models", "smollm2", "--dtypes", "bfloat16",
                            "--block-size", "32", "--out", str(first)]) == 0
    result = json.loads(first.with_suffix(".json").read_text())
    assert result["plan"]["block_size"] == 32 and "with 32-token blocks" in first.read_text()
    assert all(r["unexpected"] == [] for r in result["ttft"])
    capsys.readouterr()
    second = tmp_path / "second.md"
    assert gpu_report.main(["--smoke", "--sections", "kernels", "--merge", str(first.with_suffix(".json")),
                            "--out", str(second)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "32-token blocks" in err[0] and not second.exists()


def test_graph_steps_builds_smollm2s_shape_without_the_embedded_tokenizer(tmp_path):
    from benchmarks.suites.gpu import graph_steps

    from kvstrata.engine import model_loader

    original = model_loader.embedded_tokenizer
    loaded = graph_steps.load("smollm2-shape", torch.float32, "cpu", tmp_path)
    assert model_loader.embedded_tokenizer is original  # the stand-in was for that model alone
    cfg = loaded.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
    [row] = decoder_step.measure_model(loaded, 16, 1, [c for c in decoder_step.CASES if c.name == "question"])
    assert row["graphs_s"] is None  # graphs need CUDA; the eager paths agree (asserted in float32)
    assert row["agreement"]["transformers"]["same_top_token"] == 1.0
