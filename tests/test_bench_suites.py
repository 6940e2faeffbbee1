"""The benchmark suites as a whole: each entry point lists its subcommands and answers `--help` (every
subcommand's too, which imports its module), a bad subcommand is one line, the quick modes run (the other
suites' runs are in their own tests: test_bench_ttft, test_bench_kv_cache_dtype, test_gpu_report,
test_bench_startup, test_soak, ...), and the modules import one way (entry points -> helpers and
benchmarks/lib and benchmarks/suites, never an entry point, no circles)."""
from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

BENCH = REPO_ROOT / "benchmarks"
ENTRY_POINTS = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
# the suites that dispatch to benchmarks/suites/SUITE/ (harness.run_suite); soak, planner and scoring parse their own options
SUITES = [name for name in ENTRY_POINTS if "SUBCOMMANDS" in (BENCH / f"{name}.py").read_text()]


def suite(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def test_the_benchmarks_are_a_few_suites():
    assert {"ttft", "tiers", "kernels", "gpu", "host", "invariance"} <= set(SUITES)
    assert len(ENTRY_POINTS) <= 10, ENTRY_POINTS


@pytest.mark.parametrize("name", SUITES)
def test_a_suite_lists_every_subcommand_with_its_help(name, capsys):
    assert suite(name).main(["--help"]) == 0
    out = capsys.readouterr().out
    for subcommand in suite(name).SUBCOMMANDS:
        assert f"  {subcommand.name}  " in out or f"  {subcommand.name} " in out, subcommand.name


@pytest.mark.parametrize("name", SUITES)
def test_every_subcommand_answers_help(name, capsys):
    # --help imports the subcommand's module and builds its parser: a module moved without its imports fails here
    for subcommand in suite(name).SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_:
            suite(name).main([subcommand.name, "--help"])
        assert exit_.value.code == 0, subcommand.name
        assert "usage:" in capsys.readouterr().out, subcommand.name


@pytest.mark.parametrize("name", sorted(set(ENTRY_POINTS) - set(SUITES)))
def test_the_other_entry_points_answer_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        suite(name).main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_an_unknown_or_missing_subcommand_is_one_line(capsys):
    assert suite("tiers").main(["promote"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown subcommand 'promote'" in err and "promotion" in err
    assert suite("tiers").main([]) == 2  # the list of subcommands, as a usage error


def test_kernels_quick_mode_checks_paging_against_sdpa(capsys):
    assert suite("kernels").main(["paging", "--quick", "--repeats", "1", "--device", "cpu"]) in (0, None)
    assert "| SmolLM2-135M prefill: 2 x (64 cached + 16 new) | float32 |" in capsys.readouterr().out


def test_kernels_paging_times_another_cpu_kernel_source_beside_this_trees(capsys):
    """`--baseline-kernel`: another kernel source (here this tree's own) built and checked against SDPA beside
    this tree's."""
    from kvstrata.kernels import cpu_attention

    if not cpu_attention.available():
        pytest.skip("no C compiler to build the CPU kernel")
    pinned = REPO_ROOT / "kernels" / "cpu_attention.c"
    assert suite("kernels").main(["paging", "--quick", "--repeats", "1", "--device", "cpu",
                                  "--baseline-kernel", str(pinned)]) in (0, None)
    out = capsys.readouterr().out
    assert "| baseline kernel (ms) |" in out and "| baseline / kernel |" in out
    assert "| SmolLM2-135M prefill: 2 x (64 cached + 16 new) | float32 |" in out


def test_kernels_paging_writes_its_tables_and_every_figure_with_out(tmp_path, capsys):
    """`paging --out FILE`: the tables as printed, in FILE, and each row's seconds a call per side in the JSON
    beside it, as the table gives them."""
    out = tmp_path / "paging_run.md"
    assert suite("kernels").main(["paging", "--quick", "--repeats", "1", "--device", "cpu", "--out", str(out)]) \
        in (0, None)
    printed, report = capsys.readouterr().out, out.read_text()
    row = next(line for line in printed.splitlines() if line.startswith("| SmolLM2-135M prefill: 2 x (64 cached"))
    assert row in report
    timings = json.loads(out.with_suffix(".json").read_text())["timings"]
    assert [t["case"] for t in timings] == ["SmolLM2-135M prefill: 2 x (64 cached + 16 new)"]
    seconds = timings[0]["seconds_per_call"]
    assert "SDPA contiguous" in seconds and all(s > 0 for s in seconds.values())
    assert all(f"{s * 1e3:.3f}" in row for s in seconds.values())


def test_kernels_cpu_linear_against_another_source_keeps_every_figure_in_its_json(tmp_path):
    """`cpu-linear --baseline-kernel`: both sides' seconds a call, per product and per cache hit, are in the JSON
    beside the report, as its tables give them."""
    from kvstrata.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("no C compiler to build the CPU kernel")
    out = tmp_path / "linear.md"
    assert suite("kernels").main(["cpu-linear", "--rows", "1", "5", "--shapes", "o", "--dtypes", "float32",
                                  "--repeats", "1", "--hit-rows", "1", "--out", str(out),
                                  "--baseline-kernel", str(REPO_ROOT / "kernels" / "cpu_linear.c")]) in (0, None)
    result = json.loads(out.with_suffix(".json").read_text())
    products = result["seconds_per_call"]
    assert [(p["dtype"], p["threads"], p["shape"], p["M"]) for p in products] == [("float32", 1, "o", 1),
                                                                                ("float32", 1, "o", 5)]
    assert all(p["cpu_linear"] > 0 and p["baseline"] > 0 for p in products)
    assert [(h["dtype"], h["M"]) for h in result["hits"]] == [("float32", 1)]
    assert f"{products[1]['cpu_linear'] * 1e3:.3f}" in out.read_text()


def test_kernels_paging_bits_tells_an_equal_kernel_from_one_that_rounds_otherwise(tmp_path, capsys):
    """`--bits N`: the same source gives every bit of this tree's kernel; one whose score scale is off by one ulp
    is caught (exit 1, the differing call named)."""
    from kvstrata.kernels import cpu_attention

    if not cpu_attention.available():
        pytest.skip("no C compiler to build the CPU kernel")
    source = REPO_ROOT / "kernels" / "cpu_attention.c"
    same, off = tmp_path / "same", tmp_path / "off"
    for folder in (same, off):
        folder.mkdir()
        for header in source.parent.glob("*.h"):
            (folder / header.name).write_bytes(header.read_bytes())
    text = source.read_text()
    (same / "cpu_attention.c").write_text(text)
    assert text.count("    Problem p = {") == 1
    (off / "cpu_attention.c").write_text(text.replace("    Problem p = {", "    scale = nextafterf(scale, 1.0f);\n    Problem p = {"))
    args = ["paging", "--device", "cpu", "--bits", "4", "--baseline-kernel"]
    assert suite("kernels").main([*args, str(same / "cpu_attention.c")]) == 0
    assert "4 random calls (seed 0)" in capsys.readouterr().out
    assert suite("kernels").main([*args, str(off / "cpu_attention.c")]) == 1
    assert "call 0 (this CPU's flags): bits differ" in capsys.readouterr().out


def test_tiers_disk_readers_reads_every_layout_through_the_record_checks(tmp_path):
    assert suite("tiers").main(["disk-readers", "--processes", "2", "--gib", "0.005", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "disk_read_scaling.json").read_text())
    assert [row["layout"] for row in result["rows"]] == ["SmolLM2-135M", "Llama-3-8B"]
    for row in result["rows"]:
        assert row["processes"] == 2 and row["blocks"] > 0
        assert min(row["first_pass_gbps"], row["second_pass_gbps"], row["memory_gbps"]) > 0
    assert result["command"].startswith("python ")  # the report quotes what ran it
    assert "| SmolLM2-135M | 2 |" in (tmp_path / "disk_read_scaling.md").read_text()


def test_a_result_says_what_produced_it_in_its_json_and_its_reports_first_lines(tmp_path, capsys):
    from benchmarks.lib import results

    result = {"rows": [1, 2], "data": str(REPO_ROOT / "benchmarks" / "data" / "x.jsonl")}
    report = results.write(tmp_path, result, ["# A benchmark", "", "| a | b |"], name="demo")
    written = json.loads((tmp_path / "demo.json").read_text())
    assert list(written)[:4] == ["benchmark", "command", "machine", "source"] and written["rows"] == [1, 2]
    assert written["benchmark"] == "demo" and written["data"] == "benchmarks/data/x.jsonl"  # no machine's paths
    head = report.read_text().splitlines()[:6]
    assert head[0] == "# A benchmark" and head[2].startswith("Command: `python ")
    assert head[3].startswith("Machine: ") and head[4].startswith("Code: commit ")
    # a report that gives its command first is left as it is
    results.write(tmp_path, written, ["# Again", "", f"Command: `{written['command']}`", "", "text"], name="again")
    assert (tmp_path / "again.md").read_text().count("Command: `") == 1


def test_planner_quick_mode_writes_a_sample_trace(tmp_path):
    out = tmp_path / "trace.jsonl"
    assert suite("planner").main(["sample", str(out), "--requests", "20"]) in (0, None)
    assert len(out.read_text().splitlines()) == 20


def _benchmark_imports(path: Path, modules: set[str]) -> set[str]:
    """The `benchmarks` modules `path` imports, dotted below `benchmarks` (`lib.harness`, `suites.ttft.pressure`,
    ...): `from benchmarks.X import y` names `X.y` where that is a module, else `X`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
            base = node.module.split(".", 1)[1] if "." in node.module else ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}".lstrip(".")
                names.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("benchmarks.")}
    return names


def test_no_benchmark_imports_another_entry_point():
    # Entry points share code through harness, machine and benchmarks/lib only, so that none runs another's
    # import-time setup and no two import each other (ttft_pressure.py and machine.py once did).
    modules = {str(p.relative_to(BENCH).with_suffix("")).replace("/", "."): p for p in BENCH.rglob("*.py")
               if "data" not in p.parts and p.name != "__init__.py"}
    for name, path in sorted(modules.items()):
        imported = _benchmark_imports(path, set(modules))
        assert not imported & set(ENTRY_POINTS), f"{name} imports entry points {imported & set(ENTRY_POINTS)}"
        assert imported <= set(modules), f"{name} imports {imported - set(modules)}, which do not exist"
        if name.startswith(("lib.", "suites.")):
            assert 'if __name__ == "__main__"' not in path.read_text(), f"{name} is a script; run it from a suite"
    # and no circles among the helpers
    graph = {name: _benchmark_imports(path, set(modules)) & set(modules) for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: tuple[str, ...]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import circle: {' -> '.join((*trail, name, dep))}"
            if dep not in state:
                visit(dep, (*trail, name))
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, ())
