"""The direction of imports: kernels know nothing of tiers, tiers nothing of the engine, and the
engine nothing of the serving layer or the `kvstrata` facade (which imports them all). Checked on
the source of every module, imports inside functions and under TYPE_CHECKING included."""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = {"engine", "tiers", "kernels", "serving"}
FACADE = "kvstrata (the facade: __init__, cli, __main__)"

# What each inner package must not import: the layers above it, and the facade.
FORBIDDEN = {
    "kernels": {"kvstrata.tiers", "kvstrata.engine", "kvstrata.serving", FACADE},
    "tiers": {"kvstrata.engine", "kvstrata.serving", FACADE},
    "engine": {"kvstrata.serving", FACADE, "fastapi", "starlette", "uvicorn", "prometheus_client"},
}


PRODUCT_FOLDERS = ("kvstrata", "engine", "tiers", "kernels")


def module_name(path: Path) -> str:
    """The name `path` is imported by: kvstrata.<...>, the top-level engine/, tiers/ and kernels/ included."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] != "kvstrata":
        parts.insert(0, "kvstrata")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True)
class ImportStatement:
    """One import statement: the module it names, made absolute (`from a import b`: a), what `from` takes of it,
    and whether it sits under `if TYPE_CHECKING:` (annotations only: it never runs)."""

    module: str
    names: tuple[str, ...]
    type_checking: bool


def import_statements(path: Path, name: str) -> list[ImportStatement]:
    """Every import statement of `path`, the module `name`, inside functions too: the one reader of imports that both
    checks below interpret, the layers (everything named counts) and the circles (only what runs)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                 for stmt in block.body for node in ast.walk(stmt)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    statements = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements += [ImportStatement(alias.name, (), id(node) in type_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) + 1 - node.level]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            statements.append(ImportStatement(module, tuple(a.name for a in node.names), id(node) in type_only))
    return statements


def imported_modules(path: Path, name: str) -> set[str]:
    """Every module or name `path` imports, annotations included, as absolute names (`from kvstrata import x`:
    kvstrata.x, which `layer_of` reads as the subpackage x, or else the facade)."""
    statements = import_statements(path, name)
    return ({f"{s.module}.{n}" if s.module else n for s in statements for n in s.names}
            | {s.module for s in statements if not s.names})


def layer_of(module: str) -> str:
    """The layer a module name belongs to: a subpackage, the facade, or the top-level package name."""
    parts = module.split(".")
    if parts[0] == "kvstrata":
        return f"kvstrata.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else FACADE
    return parts[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_inner_packages_import_nothing_from_the_layers_above_them(package):
    modules = sorted((REPO / package).rglob("*.py"))  # subfolders too (engine/config/)
    assert modules, f"no modules found under {package}/"
    violations = [f"{path.relative_to(REPO)} imports {name}"
                  for path in modules
                  for name in sorted(imported_modules(path, module_name(path)))
                  if layer_of(name) in FORBIDDEN[package]]
    assert violations == []


def test_the_check_sees_every_way_of_importing_a_forbidden_layer(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("import kvstrata\nfrom kvstrata import __version__\nfrom kvstrata import serving\n"
                      "from kvstrata.serving.app import build_app\nfrom ..serving import metrics\n"
                      "def f():\n    import fastapi\n")
    layers = {layer_of(name) for name in imported_modules(source, "kvstrata.engine.module")}
    assert layers == {FACADE, "kvstrata.serving", "fastapi"}


def test_a_checkout_imports_its_own_subpackages_without_an_install(tmp_path):
    """On a machine set up by hand (a GPU one: the project's copy installed elsewhere, or none), a command run in the
    checkout imports the checkout's `kvstrata` folder first; its engine, tiers and kernels must come with it, from
    the checkout's top-level folders, as pyproject's package-dir maps them in an install."""
    import subprocess
    import sys

    # -S: no site-packages, so neither an installed nor an editable copy can answer for the checkout
    code = ("import kvstrata.engine.sizes as e, kvstrata.tiers.names as t, kvstrata.kernels.backends as k; "
            "print(e.__file__, t.__file__, k.__file__)")
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    found = [Path(name).resolve() for name in run.stdout.split()]
    assert found == [REPO / "engine" / "sizes.py", REPO / "tiers" / "names.py", REPO / "kernels" / "backends.py"]


def runtime_imports(path: Path, name: str) -> set[str]:
    """The modules `path` imports when it runs (inside functions too), as absolute names, leaving out imports
    under `if TYPE_CHECKING:`. `from package import x` names package and package.x: `import_graph` keeps
    package.x alone where x is a module (the package's own __init__ importing its submodules is no circle)."""
    names = set()
    for statement in import_statements(path, name):
        if not statement.type_checking:
            names.add(statement.module)
            names.update(f"{statement.module}.{n}" for n in statement.names)
    return names


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of `paths` it imports at run time."""
    by_name = {module_name(path): path for path in paths}
    graph = {}
    for name, path in by_name.items():
        imported = runtime_imports(path, name)
        # `from package import submodule` also yields `package`; only the submodule is the dependency
        graph[name] = {m for m in imported if m in by_name and m != name
                       and not any(other.startswith(m + ".") for other in imported if other in by_name)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_no_two_product_modules_import_each_other():
    """A circle (a module importing one that imports it back, however indirectly) means neither can be read, tested
    or moved alone: cli and the planner, the router and the server, a kernel and the backends that load it were
    such circles."""
    paths = [path for folder in PRODUCT_FOLDERS for path in sorted((REPO / folder).rglob("*.py"))]
    assert circles(import_graph(paths)) == []


def test_the_circle_check_finds_a_circle_through_a_function_level_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "kvstrata").mkdir()
    (tmp_path / "kvstrata" / "cli.py").write_text("from kvstrata import planner\n")
    (tmp_path / "kvstrata" / "planner.py").write_text("def main():\n    from kvstrata.cli import main\n")
    (tmp_path / "kvstrata" / "trace.py").write_text("from typing import TYPE_CHECKING\n"
                                                    "if TYPE_CHECKING:\n    from kvstrata.cli import main\n")
    graph = import_graph(sorted((tmp_path / "kvstrata").glob("*.py")))
    assert circles(graph) == [["kvstrata.cli", "kvstrata.planner"]]
    assert graph["kvstrata.trace"] == set()  # annotations only


def test_product_code_imports_neither_benchmarks_nor_tests():
    paths = [path for folder in PRODUCT_FOLDERS for path in sorted((REPO / folder).rglob("*.py"))]
    offenders = [f"{path.relative_to(REPO)} imports {name}" for path in paths
                 for name in sorted(runtime_imports(path, module_name(path)))
                 if name.split(".")[0] in ("benchmarks", "tests")]
    assert offenders == []
