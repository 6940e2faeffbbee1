"""The benchmarks' counts are checked as they are parsed: a count below its least is refused in one line naming the
option, before a model loads (a negative --docs would otherwise slice the workload from its end)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.mark.parametrize("module, argv, says", [
    ("benchmarks.suites.ttft.pressure", ["--docs", "-1"], "argument --docs: must be a positive integer, got -1"),
    ("benchmarks.suites.ttft.pressure", ["--zipf-requests", "-1"],
     "argument --zipf-requests: must be a non-negative integer, got -1"),
    ("benchmarks.suites.ttft.pressure", ["--threads", "0"], "argument --threads: must be a positive integer, got 0"),
    ("benchmarks.suites.ttft.concurrency", ["--requests", "0"],
     "argument --requests: must be a positive integer, got 0"),
    ("benchmarks.suites.ttft.vllm", ["--decode-tokens", "ten"],
     "argument --decode-tokens: invalid positive integer value: 'ten'"),
    ("benchmarks.scoring", ["--questions", "-2"], "argument --questions: must be a positive integer, got -2"),
])
def test_a_benchmark_count_below_its_least_is_refused_naming_the_option(capsys, module, argv, says):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {says}")


def test_zero_is_taken_where_a_benchmark_says_it_means_none():
    from benchmarks.suites.ttft.pressure import parse_args

    args = parse_args(["--zipf-requests", "0", "--cold-pairs", "0"])
    assert (args.zipf_requests, args.cold_pairs) == (0, 0)
