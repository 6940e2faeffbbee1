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
