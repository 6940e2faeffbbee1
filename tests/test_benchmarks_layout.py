"""The benchmarks' layout: each suite's subcommands live in benchmarks/suites/SUITE/, one module each, named in
the suite's table; benchmarks/lib/ holds only helpers (no `main`, no parser); the common options are defined
once (lib/options.py) and results written one way (lib/results.py); every results file is indexed. Each check
reads the source only (no imports, no model) and is shown to fail on a folder made to break it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
# The program vLLM's own interpreter runs beside a peer comparison (lib/peers.py): it cannot import kvstrata or
# these helpers, so it parses its own options; it is no benchmark module.
PEER_PROGRAMS = {"vllm_side.py"}
# The helpers that may do what every other module must leave to them.
OPTIONS, RESULTS = "options.py", "results.py"
INDEXES = ("README.md", "history.md")


def common_options(bench: Path) -> set[str]:
    """The option names lib/options.py defines once (its COMMON), read from its source."""
    for node in ast.walk(ast.parse((bench / "lib" / OPTIONS).read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMON" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("lib/options.py defines no COMMON")


def benchmark_modules(bench: Path) -> list[Path]:
    """Every Python module of the benchmarks but the peers' programs (data/ holds none)."""
    return sorted(p for p in bench.rglob("*.py") if p.name not in PEER_PROGRAMS and p.name != "__init__.py")


def suite_tables(bench: Path) -> dict[str, list[tuple[str, str]]]:
    """Each suite script's table, read statically: suite -> [(subcommand, module as `SUITE.NAME`)]."""
    tables = {}
    for script in sorted(bench.glob("*.py")):
        rows = [(call.args[0].value, call.args[1].value) for call in ast.walk(ast.parse(script.read_text()))
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Subcommand"
                and len(call.args) >= 2 and all(isinstance(a, ast.Constant) for a in call.args[:2])]
        if rows:
            tables[script.stem] = rows
    return tables


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node


def call_name(call: ast.Call) -> str:
    """`f`, `obj.f` or `mod.obj.f` of a call, as written."""
    return ast.unparse(call.func)


# ---------------------------------------------------------------------------------------------- the checks

def lib_problems(bench: Path) -> list[str]:
    """lib/ holds helpers: no module there has a `main` or builds a parser (options.py builds the suites')."""
    problems = []
    for path in sorted((bench / "lib").glob("*.py")):
        if path.name in PEER_PROGRAMS:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "main" for n in tree.body):
            problems.append(f"lib/{path.name} has a main: a subcommand belongs in suites/SUITE/")
        if path.name != OPTIONS and any(call_name(c).endswith("ArgumentParser") for c in calls(path)):
            problems.append(f"lib/{path.name} builds a parser")
    return problems


def suite_problems(bench: Path) -> list[str]:
    """Every module in suites/SUITE/ is named in SUITE.py's table, every entry there exists, and each suite folder
    has its script."""
    tables = suite_tables(bench)
    problems = []
    for folder in sorted(p for p in (bench / "suites").iterdir() if p.is_dir() and p.name != "__pycache__"):
        named = {module for _, module in tables.get(folder.name, [])}
        if folder.name not in tables:
            problems.append(f"suites/{folder.name}/ has no suite script benchmarks/{folder.name}.py with a table")
        for path in sorted(folder.glob("*.py")):
            if f"{folder.name}.{path.stem}" not in named:
                problems.append(f"suites/{folder.name}/{path.name} is in no entry of {folder.name}.py's table")
    for suite, rows in tables.items():
        for subcommand, module in rows:
            if not (bench / "suites" / (module.replace(".", "/") + ".py")).is_file():
                problems.append(f"{suite}.py {subcommand}: no module benchmarks/suites/{module.replace('.', '/')}.py")
            elif module.split(".")[0] != suite:
                problems.append(f"{suite}.py {subcommand}: {module} lives under another suite")
    return problems


def option_problems(bench: Path) -> list[str]:
    """No module but options.py adds a common option or builds an argparse parser of its own."""
    common = common_options(bench)
    problems = []
    for path in benchmark_modules(bench):
        if path.name == OPTIONS and path.parent.name == "lib":
            continue
        where = path.relative_to(bench)
        for call in calls(path):
            name = call_name(call)
            if name.endswith("add_argument") and call.args and isinstance(call.args[0], ast.Constant) \
                    and call.args[0].value in common:
                problems.append(f"{where}:{call.lineno} adds {call.args[0].value} (use lib/options.py)")
            if name.endswith("ArgumentParser"):
                problems.append(f"{where}:{call.lineno} builds its own parser (use options.parser)")
    return problems


# A write whose target names a results file: the output options or a variable `out`, the results folder, a report
# or a JSON (a model's config.json, written as a fixture, is none; nor is a child's `spec["out"]` for its parent).
RESULT_TARGET = re.compile(r"out_dir|(?<![\w'\"])out(?![\w'\"])|RESULTS|results_dir|\.md\b|md_path|json_path"
                           r"|\.json\b(?<!config\.json)")


def write_target(call: ast.Call) -> ast.AST | None:
    """What `call` writes to, if it writes a file: `X.write_text(...)`, `X.write_bytes(...)`, `open(X, "w")`."""
    name = call_name(call)
    if name.endswith((".write_text", ".write_bytes")) and isinstance(call.func, ast.Attribute):
        return call.func.value
    if name == "open" and call.args:
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        if isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax"):
            return call.args[0]
    return None


def writer_problems(bench: Path) -> list[str]:
    """No module but results.py writes a result file: no `json.dump` to a file, no write to the output options,
    the results folder or a report."""
    problems = []
    for path in benchmark_modules(bench):
        if path.name == RESULTS and path.parent.name == "lib":
            continue
        where = path.relative_to(bench)
        for call in calls(path):
            target = write_target(call)
            if call_name(call) == "json.dump":
                problems.append(f"{where}:{call.lineno} json.dump to a file (use lib/results.py)")
            elif target is not None and RESULT_TARGET.search(ast.unparse(target)):
                problems.append(f"{where}:{call.lineno} writes {ast.unparse(target)} (use lib/results.py)")
    return problems


def linked_files(markdown: Path) -> set[Path]:
    """The local files a markdown file links to, resolved."""
    targets = re.findall(r"\]\(([^)#\s]+)", markdown.read_text())
    return {(markdown.parent / t).resolve() for t in targets if "://" not in t}


def index_problems(results: Path) -> list[str]:
    """Every file in results/ is linked from README.md or history.md, or from a report they link (a plot), or is
    the JSON beside a linked report; every file in archive/ is listed in archive/README.md."""
    linked, todo = set(), [results / name for name in INDEXES]
    while todo:
        markdown = todo.pop()
        if markdown in linked or not markdown.is_file():
            continue
        linked.add(markdown)
        found = linked_files(markdown)
        todo += [p for p in found if p.suffix == ".md" and results in p.parents and "archive" not in p.parts]
        linked |= {p for p in found if p.suffix != ".md"}
    problems = []
    archive = results / "archive"
    for path in sorted(p.resolve() for p in results.rglob("*") if p.is_file()):
        if archive in path.parents:
            continue
        if path in linked or (path.suffix == ".json" and path.with_suffix(".md") in linked):
            continue
        problems.append(f"results/{path.relative_to(results.resolve())} is linked from neither "
                        f"{' nor '.join(INDEXES)}: link it, or move it to archive/ and list it there")
    listed = linked_files(archive / "README.md") if (archive / "README.md").is_file() else set()
    for path in sorted(p.resolve() for p in archive.rglob("*") if p.is_file() and p.name != "README.md"):
        if path not in listed:
            problems.append(f"results/archive/{path.name} is not listed in results/archive/README.md")
    return problems


# ---------------------------------------------------------------------------------------------- this tree

def test_lib_holds_only_helpers():
    assert lib_problems(BENCH) == []


def test_every_suite_module_is_a_subcommand_in_its_suites_table():
    assert suite_problems(BENCH) == []
    assert set(suite_tables(BENCH)) >= {"ttft", "tiers", "kernels", "gpu", "host", "invariance", "cluster"}


def test_common_options_are_defined_once():
    assert option_problems(BENCH) == []


def test_only_the_results_module_writes_results():
    assert writer_problems(BENCH) == []


def test_every_results_file_is_indexed_or_archived():
    assert index_problems(BENCH / "results") == []


# ---------------------------------------------------------------------------------------------- the checks fail

@pytest.fixture
def bench(tmp_path) -> Path:
    """A benchmarks folder that passes every check: one suite with one subcommand, the two helpers, one result."""
    root = tmp_path / "benchmarks"
    (root / "lib").mkdir(parents=True)
    (root / "suites" / "demo").mkdir(parents=True)
    (root / "results" / "archive").mkdir(parents=True)
    (root / "lib" / OPTIONS).write_text('COMMON = ("--out-dir", "--repeats")\n'
                                        'def parser(doc):\n    return argparse.ArgumentParser(description=doc)\n'
                                        'def repeats(p, default):\n    p.add_argument("--repeats", default=default)\n')
    (root / "lib" / RESULTS).write_text('def write(out_dir, result):\n'
                                        '    (Path(out_dir) / "x.md").write_text("")\n    json.dump(result, f)\n')
    (root / "lib" / "helper.py").write_text("def helper():\n    return 1\n")
    (root / "demo.py").write_text('SUBCOMMANDS = (Subcommand("run", "demo.run", "runs"),)\n')
    (root / "suites" / "demo" / "run.py").write_text(
        'def main(argv):\n    p = options.parser(__doc__)\n    options.repeats(p, 3)\n'
        '    p.add_argument("--rounds", type=int)\n    (work / "config.json").write_text("{}")\n'
        '    results.write(args.out_dir, {})\n')
    (root / "results" / "README.md").write_text("[`run.md`](run.md)\n")
    (root / "results" / "history.md").write_text("")
    for name in ("run.md", "run.json"):
        (root / "results" / name).write_text("")
    (root / "results" / "archive" / "README.md").write_text("[`old.md`](old.md)\n")
    (root / "results" / "archive" / "old.md").write_text("")
    return root


def test_the_checks_pass_a_good_folder(bench):
    assert lib_problems(bench) == suite_problems(bench) == option_problems(bench) == writer_problems(bench) == []
    assert index_problems(bench / "results") == []


def test_a_subcommand_left_in_lib_or_a_helper_parsing_options_is_caught(bench):
    (bench / "lib" / "old_bench.py").write_text("def main(argv):\n    return 0\n")
    (bench / "lib" / "helper.py").write_text("import argparse\np = argparse.ArgumentParser()\n")
    assert lib_problems(bench) == ["lib/helper.py builds a parser", "lib/old_bench.py has a main: a subcommand "
                                   "belongs in suites/SUITE/"]


def test_a_module_missing_from_its_table_or_an_entry_without_a_module_is_caught(bench):
    (bench / "suites" / "demo" / "stray.py").write_text("def main(argv):\n    return 0\n")
    (bench / "demo.py").write_text('SUBCOMMANDS = (Subcommand("run", "demo.run", ""), Subcommand("gone", "demo.gone",'
                                   ' ""), Subcommand("far", "other.run", ""))\n')
    (bench / "suites" / "lonely").mkdir()
    problems = suite_problems(bench)
    assert any("stray.py is in no entry" in p for p in problems)
    assert any("demo.py gone: no module" in p for p in problems)
    assert any("demo.py far: no module" in p for p in problems)
    assert any("suites/lonely/ has no suite script" in p for p in problems)


def test_a_common_option_or_a_parser_outside_options_is_caught(bench):
    (bench / "suites" / "demo" / "run.py").write_text(
        'import argparse\ndef main(argv):\n    p = argparse.ArgumentParser()\n'
        '    p.add_argument("--out-dir", default=None)\n    p.add_argument("--rounds")\n')
    problems = option_problems(bench)
    assert len(problems) == 2
    assert "adds --out-dir" in problems[1] and "builds its own parser" in problems[0]


@pytest.mark.parametrize("write", ['(Path(args.out_dir) / "run.md").write_text(text)', "json.dump(result, f)",
                                   'open(os.path.join(args.out, "tiers.md"), "w")',
                                   '(RESULTS / "planner.json").write_text(text)', "json_path.write_text(text)",
                                   'out.with_suffix(".json").write_text(text)', 'Path(args.out).write_text(text)'])
def test_a_result_written_outside_results_is_caught(bench, write):
    (bench / "suites" / "demo" / "run.py").write_text(f"def main(argv):\n    {write}\n")
    assert len(writer_problems(bench)) == 1


def test_an_unindexed_result_or_an_unlisted_archive_file_is_caught(bench):
    (bench / "results" / "stray.md").write_text("")
    (bench / "results" / "stray.png").write_text("")
    (bench / "results" / "archive" / "older.md").write_text("")
    problems = index_problems(bench / "results")
    assert [p.split(" ")[0] for p in problems] == ["results/stray.md", "results/stray.png",
                                                   "results/archive/older.md"]
