"""What `pip install kvstrata` must bring: every third-party module the commands import at module level."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = [ROOT / "kvstrata" / "cli.py", *sorted((ROOT / "kvstrata" / "serving").glob("*.py"))]


# Installed by a declared dependency that requires it (fastapi is starlette's; pydantic needs typing-extensions).
BROUGHT_BY = {"starlette": "fastapi", "typing-extensions": "pydantic"}


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported outside functions (what importing the module needs)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"kvstrata", "__future__"}


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-") for req in project["dependencies"]}


def test_every_module_a_command_imports_is_a_declared_dependency():
    declared = declared_dependencies()
    distributions = packages_distributions()
    missing = {}
    for path in COMMAND_MODULES:
        for module in module_level_imports(path):
            dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not {BROUGHT_BY.get(d, d) for d in dists} & declared:
                missing[f"{path.relative_to(ROOT)}: {module}"] = sorted(dists)
    assert not missing, f"imported at module level but not in pyproject's dependencies: {missing}"


PACKAGE_MODULES = [path for folder in ("kvstrata", "engine", "tiers", "kernels") for path in sorted((ROOT / folder).rglob("*.py"))]
# Imported only where an optional feature is used, each with a one-line error that says how to install it.
OPTIONAL = {"redis": "pip install 'kvstrata[remote]'", "matplotlib": "--plot needs matplotlib (pip install matplotlib)"}


def every_import(path: Path) -> set[str]:
    """Top-level package names imported anywhere in the module, inside functions too (what its commands need)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"kvstrata", "__future__"}


def installed_with(declared: set[str]) -> set[str]:
    """The distributions `pip install kvstrata` brings: the declared ones and, recursively, what they require
    (extras left out), as this environment's metadata says."""
    from importlib.metadata import PackageNotFoundError, requires

    seen, todo = set(), list(declared)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = requires(name) or []
        except PackageNotFoundError:
            continue  # a marker left it out here (triton off Linux)
        for requirement in requirements:
            if "extra ==" not in requirement.replace('"', "").replace("'", ""):
                todo.append(re.split(r"[<>=!~;\[ (]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    return seen


def test_every_module_the_package_imports_anywhere_is_installed_with_it_or_says_how_to_install_it():
    """Beyond the commands' module-level imports: the ones inside functions too (`kvstrata serve` imports the
    engine, which imports torch, transformers, ...), so no command stops with a ModuleNotFoundError after
    `pip install kvstrata`. An optional feature's module is allowed when the source says how to get it."""
    installed = installed_with(declared_dependencies())
    distributions = packages_distributions()
    source = "\n".join(path.read_text() for path in PACKAGE_MODULES)
    missing = {}
    for path in PACKAGE_MODULES:
        for module in every_import(path):
            if module in OPTIONAL:
                assert OPTIONAL[module] in source, f"{module}: no error says how to install it"
                continue
            dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not dists & installed:
                missing[f"{path.relative_to(ROOT)}: {module}"] = sorted(dists)
    assert not missing, f"imported but installed by no declared dependency: {missing}"
